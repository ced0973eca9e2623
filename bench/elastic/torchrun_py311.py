"""torchrun 1.13 for Python 3.11: the same entry point with one fix.

torchrun 1.13 parses its own default `--redirects 0` / `--tee 0` with Std.from_str, which looks
the value up by iterating the Std flag enum; Python 3.11 no longer yields the zero (NONE) and
combined (ALL) members when iterating a Flag, so the lookup returns None and torchrun crashes.
This wrapper makes the lookup use Std(value) and then runs torchrun unchanged.
"""

import re
import sys

from torch.distributed.elastic.multiprocessing import api
from torch.distributed.run import main


def _from_str(vm):
    if re.fullmatch(r"[0-3]", vm):
        return api.Std(int(vm))
    return {int(i): api.Std(int(v)) for i, v in (m.split(":") for m in vm.split(","))}


api.Std.from_str = staticmethod(_from_str)

if __name__ == "__main__":
    sys.exit(main())
