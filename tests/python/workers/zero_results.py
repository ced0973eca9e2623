"""What the ZeroRedundancyOptimizer tests read from their workers' RESULT records (issue #35):
the job's Adam state assembled from every rank's shard."""


def whole_state(results):
    """The Adam state of the job by global parameter index (every rank's shard), checking
    that the shards do not overlap and that the ranks hold the same parameters."""
    state = {}
    for r in results:
        for i, v in r["shard"].items():
            assert i not in state, "parameter %s in two shards" % i
            state[i] = v
        assert r["params"] == results[0]["params"], "ZeRO broadcasts the parameters"
    return state
