"""The torch-free bottom layer: options, the env contract, launch detection, exit codes, the process state."""
