"""The `pagedserve bench` subcommands (the standalone scripts are in bench/scripts/, not installed)."""
