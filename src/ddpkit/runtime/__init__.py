"""The process group and what runs beside training in each worker: start and stop, collectives, faults, tool hooks."""
