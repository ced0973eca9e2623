"""Data correctness across a change of world size (docs/data-and-resume.md).

A random case: an epoch of n samples, k steps of batch B done at world size W1 and committed, the
job restarted at W2, the rest of the epoch trained. Positions refer to the epoch order P, which
does not depend on the world size; part 1 consumed exactly P[:G] with G = k * B * W1.
"""

import collections
import itertools
import math
import random

import pytest

from efdl.data import DistributedSampler
from efdl.resume import exact_resume, resume_step


def make(n, world, rank, case, **start):
    return DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=case["shuffle"],
                              seed=case["seed"], drop_last=case["drop_last"], epoch=case["epoch"],
                              **start)


def train_steps(samplers, batch_size, steps=None):
    """What `steps` DataLoader steps (all of them if None) of every rank consume."""
    seen = []
    for sampler in samplers:
        indices = list(sampler)
        seen += indices if steps is None else indices[:steps * batch_size]
    return seen


def random_cases(count, seed):
    rng = random.Random(seed)
    made = 0
    while made < count:
        case = dict(n=rng.randrange(1, 200), w1=rng.randrange(1, 9), w2=rng.randrange(1, 9),
                    batch=rng.randrange(1, 9), drop_last=rng.random() < 0.5,
                    shuffle=rng.random() < 0.7, seed=rng.randrange(1000), epoch=rng.randrange(4))
        per_rank = len(make(case["n"], case["w1"], 0, case))
        batches = math.ceil(per_rank / case["batch"])
        if batches < 2:
            continue  # no step can be committed before the epoch ends
        case["k"] = rng.randrange(1, batches)  # full batches done, the epoch not finished
        made += 1
        yield case


def resume_and_finish(case, start):
    samplers = [make(case["n"], case["w2"], r, case, **start) for r in range(case["w2"])]
    return samplers[0].global_start_index, train_steps(samplers, case["batch"])


def account(case, part1, part2, resumed_at):
    """(missing samples, extra visits beyond the padding the sampler adds at W2)."""
    n, w2 = case["n"], case["w2"]
    visits = collections.Counter(part1) + collections.Counter(part2)
    missing = n - len(visits)
    padding = 0 if case["drop_last"] else len(part2) - (n - resumed_at)
    assert 0 <= padding < w2
    extra = sum(visits.values()) - len(visits) - padding
    return missing, extra


@pytest.mark.parametrize("seed", [1, 2])
def test_spec_formula_loses_nothing_and_repeats_at_most_what_the_docs_say(seed):
    for case in random_cases(800, seed):
        n, w1, w2, b, k = case["n"], case["w1"], case["w2"], case["batch"], case["k"]
        part1 = train_steps([make(n, w1, r, case) for r in range(w1)], b, k)
        consumed = k * b * w1
        assert len(set(part1)) == consumed == len(part1)
        committed_step = k - 1  # the spec's loop commits after batch `step`
        step = resume_step(committed_step, w1, w2)
        resumed_at, part2 = resume_and_finish(case, dict(start_index=step * b))
        repeated = consumed - resumed_at
        if w1 == w2 or committed_step == 0:
            assert repeated == b * w1  # the committed batch again (one per old replica)
        else:
            assert repeated == b * ((k * w1) % w2) < b * w2  # under one batch per new replica
        missing, extra = account(case, part1, part2, resumed_at)
        if case["drop_last"]:
            assert missing < w2, case  # drop_last's tail at the new size, as torch drops < W
            assert extra <= repeated
        else:
            assert missing == 0, case
            assert extra == repeated, case


@pytest.mark.parametrize("seed", [3, 4])
def test_exact_resume_loses_and_repeats_nothing(seed):
    for case in random_cases(800, seed):
        n, w1, w2, b, k = case["n"], case["w1"], case["w2"], case["batch"], case["k"]
        part1 = train_steps([make(n, w1, r, case) for r in range(w1)], b, k)
        point = exact_resume(len(part1), b, w2)  # samples: len(batch) * W1 summed over k steps
        assert point.step == (k * b * w1) // (b * w2)
        resumed_at, part2 = resume_and_finish(
            case, dict(global_start_index=point.global_start_index))
        missing, extra = account(case, part1, part2, resumed_at)
        assert extra == 0, case
        assert missing == 0 if not case["drop_last"] else missing < w2, case


def test_exact_resume_across_several_resizes_in_one_epoch():
    rng = random.Random(5)
    for _ in range(300):
        case = dict(n=rng.randrange(20, 300), batch=rng.randrange(1, 6), drop_last=False,
                    shuffle=True, seed=rng.randrange(100), epoch=0)
        sizes = [rng.randrange(1, 7) for _ in range(rng.randrange(2, 5))]
        samples, seen = 0, []
        for i, world in enumerate(sizes):
            start = exact_resume(samples, case["batch"], world).global_start_index
            samplers = [make(case["n"], world, r, case, global_start_index=start)
                        for r in range(world)]
            batches = math.ceil(len(samplers[0]) / case["batch"])
            last = i == len(sizes) - 1
            steps = None if last else rng.randrange(0, max(batches, 1))
            done = train_steps(samplers, case["batch"], steps)
            seen += done
            samples += len(done)  # = sum of len(batch) * world over the steps
        visits = collections.Counter(seen)
        assert len(visits) == case["n"], (case, sizes)
        assert len(seen) - case["n"] < sizes[-1]  # only the final size's padding repeats


def test_resume_step_matches_the_spec_formula():
    for step, w1, w2 in itertools.product(range(0, 50), range(1, 9), range(1, 9)):
        expected = step if (w1 == w2 or step == 0) else math.floor((step + 1) * 1.0 * w1 / w2)
        assert resume_step(step, w1, w2) == expected


@pytest.mark.parametrize("call, message", [
    (lambda: resume_step(-1, 2, 3), "step=-1"),
    (lambda: resume_step(3, 0, 3), "old_world_size=0"),
    (lambda: exact_resume(10, 0, 3), "batch_size=0"),
    (lambda: exact_resume(-5, 4, 3), "samples=-5"),
])
def test_bad_resume_arguments_get_a_clear_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_documented_exact_loop_with_dataloaders_visits_every_sample_once():
    """docs/data-and-resume.md's loop, with real DataLoaders stepping the ranks in lockstep:
    `samples += len(batch) * world` per step, the sampler resumed from it after each resize."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    dataset = TensorDataset(torch.arange(103))
    batch_size, samples, seen = 4, 0, []
    for world, steps in [(3, 4), (2, 5), (5, 1), (4, None)]:
        loaders = [DataLoader(dataset, batch_size=batch_size, sampler=DistributedSampler(
            dataset, num_replicas=world, rank=r, epoch=2, global_start_index=samples))
            for r in range(world)]
        for i, batches in enumerate(zip(*loaders)):
            if steps is not None and i == steps:
                break  # the job is resized here, right after a commit
            assert len({len(b[0]) for b in batches}) == 1, "ranks must step the same amount"
            seen += [int(x) for (b,) in batches for x in b]
            samples += len(batches[0][0]) * world
    counts = collections.Counter(seen)
    assert sorted(counts) == list(range(103))
    assert len(seen) - 103 < 4  # only the last world size's padding repeats
