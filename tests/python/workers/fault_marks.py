"""One-shot faults of the test workers (faults/worker.py, elastic_run_worker.py): a fault fires
once per job, however many times a restarted or re-rounded worker reaches it, through a marker
file per fault in a directory the job's workers share."""

import os


def once(marks, name):
    """True the first time fault `name` fires: creates `marks`/`name` (O_EXCL, so one process
    wins). Always True when `marks` (the job's marker directory) is not given."""
    if not marks:
        return True
    try:
        os.close(os.open(os.path.join(marks, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False
