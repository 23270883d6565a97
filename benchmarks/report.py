"""Where a benchmark's results go besides its printed lines: a JSON file, when --json names one."""

import json


def write_json(path: str | None, results) -> None:
    if path:
        with open(path, "w") as file:
            json.dump(results, file, indent=2)
