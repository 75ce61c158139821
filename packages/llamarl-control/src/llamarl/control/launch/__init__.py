"""Starting a job's ranks and ending it: torch elastic (`launcher.py`), what each rank runs (`spmd.py`),
devices and backends (`devices.py`), CPU threads (`threads.py`), machines (`nodes.py`), how a run that
does not finish ends (`failures.py`), and the memory of every process of the run (`memory.py`)."""
