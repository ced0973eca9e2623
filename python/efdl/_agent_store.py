"""The agent store: torch's own TCPStore server, kept by a node's agent for the agent's whole life.

The agent runs this module in one of its pre-started spares (`-m efdl._agent_store`), so it
costs a fork of the zygote, not an interpreter start. The protocol is owned by
src/agent/agent_store.h: once the server listens, this prints one line on stdout,

    EFDL_AGENT_STORE_PORT=<port>

and then serves until the agent kills it (it dies with the agent). Workers of a round whose
rank-0 node offers the store connect to it as clients (TORCHELASTIC_USE_AGENT_STORE=True), each
round under its own key prefix, so a new round's ranks never wait for a rank 0 that is still
starting its server (torch 1.13 retries a refused connection only once a second).
"""

import ctypes
import datetime
import signal
import sys

import torch.distributed as dist

PORT_LINE = "EFDL_AGENT_STORE_PORT="   # src/agent/agent_store.h kAgentStorePortLine
NAME = b"efdl-store"                   # its name in ps -o comm (src/agent/agent_store.h)
_PR_SET_NAME = 15


def main():
    ctypes.CDLL(None).prctl(_PR_SET_NAME, NAME, 0, 0, 0)
    # Port 0: the kernel picks a free one; the server listens on every address (the other nodes
    # reach it at the rank-0 node's advertise address). The timeout bounds this process's own
    # client only, which does nothing after the start.
    store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=60),
                          wait_for_workers=False)
    print(PORT_LINE + str(store.port), flush=True)
    while True:
        signal.pause()   # SIGKILL from the agent, or PR_SET_PDEATHSIG when the agent dies


if __name__ == "__main__":
    sys.exit(main())
