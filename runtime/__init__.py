"""What every process of a deployment runs with but never sends: the serve options, the torch
environment, the CPU dtype rule, and how a process exits. Imports only ``protocol``."""
