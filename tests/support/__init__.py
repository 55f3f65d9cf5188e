"""Helpers the tests import (never collected: no name here starts with ``test_``)."""
