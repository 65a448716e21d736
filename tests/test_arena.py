"""StepArena (dynar/nn/arena.py): the arrays a model's layers hand each other, laid out in one
block by when each is alive. What must hold: arrays alive at once never share memory, a
value stays put until its array is given back, a pass that strays from the planned one is
still right, and a model trains bit for bit as with a buffer in every layer."""
import mmap

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from dynar import models, nn, optim
from dynar.nn import StepArena


def _run_pass(arena, key, script, keep_longer=()):
    """Takes and gives back as `script` says: ("take", shape) or ("give", n), giving back
    the n-th oldest array still held. Each array is filled with its own number and checked
    when given back; arrays alive together must not share memory. Arrays whose take index
    is in keep_longer are given back only at the end. Returns the take count."""
    arena.begin(key)
    held, late, taken = [], [], 0
    for op, arg in script:
        if op == "take":
            array = arena.take(arg)
            for _, other in held + late:
                assert not np.shares_memory(array, other)
            array.fill(taken)
            (late if taken in keep_longer else held).append((taken, array))
            taken += 1
        elif held:
            number, array = held.pop(arg % len(held))
            assert (array == number).all(), "overwritten while alive"
            arena.passed_on(array)
    for number, array in held + late:
        assert (array == number).all(), "overwritten while alive"
        arena.passed_on(array)
    arena.finish()
    return taken


scripts = st.lists(st.one_of(
    st.tuples(st.just("take"), st.tuples(st.integers(1, 40), st.integers(1, 40))),
    st.tuples(st.just("give"), st.integers(0, 10))), max_size=40)


@settings(max_examples=60, deadline=None)
@given(scripts)
def test_arrays_alive_together_never_share_memory(script):
    arena = StepArena(min_bytes=0)
    _run_pass(arena, "k", script)           # recorded
    for _ in range(2):                      # then planned
        _run_pass(arena, "k", script)
        assert arena.followed_plan


@settings(max_examples=40, deadline=None)
@given(scripts, st.integers(0, 5))
def test_a_pass_that_keeps_an_array_longer_is_still_right(script, late):
    arena = StepArena(min_bytes=0)
    _run_pass(arena, "k", script)
    _run_pass(arena, "k", script, keep_longer={late})   # may stray from the plan
    _run_pass(arena, "k", script, keep_longer={late})   # planned for it
    assert arena.followed_plan


def test_a_chain_plans_the_most_alive_at_once():
    # A layer chain's backward: each gradient given back once the next is taken.
    arena = StepArena(min_bytes=0)
    sizes = [(64, 1000), (64, 4000), (64, 2000), (64, 3000)]
    for _ in range(2):
        arena.begin("k")
        previous = arena.take(sizes[0])
        for shape in sizes[1:]:
            current = arena.take(shape)
            arena.passed_on(previous, current)
            previous = current
        arena.passed_on(previous)
    arena.finish()
    most = max(a * b + c * d for (a, b), (c, d) in zip(sizes, sizes[1:])) * 4
    assert most <= arena.nbytes <= most + 64 * len(sizes)
    assert not arena.small("k") and StepArena().small("k") is False
    small = StepArena()
    small.begin("k")
    small.passed_on(small.take((4, 4)))
    small.finish()
    assert small.small("k") and not small.small("other")


@pytest.mark.parametrize("name, variant", [("lenet", None), ("alexnet", "cifar"),
                                           ("vgg11_bn", "cifar"), ("resnet18", "cifar")])
def test_a_model_trains_bit_for_bit_as_with_its_own_buffers(name, variant, rng):
    # The arena is forced on (min_bytes=0: 4 images are a small pass) for one twin and off
    # for the other; a residual block hands its gradient to two branches (share). Poisoned:
    # an array read after it was given back holds NaN, whatever the layout.
    def build(arena):
        model = models.get(name, num_classes=10, seed=3,
                           **({"variant": variant} if variant else {}))
        model.step_arena = arena
        return model, optim.SGD(model, lr=0.05, momentum=0.9), nn.CrossEntropyLoss()

    twins = [build(StepArena(min_bytes=0, poison=True)), build(None)]
    for step in range(4):
        x = rng.standard_normal((4,) + tuple(twins[0][0].input_shape), dtype=np.float32)
        y = rng.integers(0, 10, 4)
        logits = []
        for model, opt, crit in twins:
            model.zero_grad()
            out = model.forward(x)
            logits.append(out.copy())
            crit.forward(out, y)
            model.backward(crit.backward())
            opt.step()
        np.testing.assert_array_equal(logits[0], logits[1])
    arena = twins[0][0].step_arena
    assert arena.nbytes > 0 and twins[0][0]._arena is arena
    np.testing.assert_array_equal(twins[0][0].flat_params, twins[1][0].flat_params)


@pytest.mark.skipif(not hasattr(mmap, "MADV_REMOVE"), reason="needs Linux's MADV_REMOVE")
def test_an_array_given_back_returns_its_memory_at_once():
    # Fresh arrays of 1 MB and more have a mapping of their own; given back, its pages go,
    # though something still refers to the array (a layer's output given back in forward),
    # so they read as zeros after. A poisoned arena fills instead.
    arena = StepArena(min_bytes=0)
    arena.begin("k")
    big, small = arena.take((512, 1024)), arena.take((8, 8))
    big.fill(1.0)
    small.fill(1.0)
    arena.passed_on(big)
    arena.passed_on(small)
    assert not big.any() and (small == 1).all()


@pytest.mark.parametrize("name, variant", [("alexnet", "cifar"), ("resnet18", "cifar")])
def test_a_model_output_stays_valid_after_its_backward(name, variant, rng):
    model = models.get(name, num_classes=10, variant=variant, seed=3)
    model.step_arena = StepArena(min_bytes=0, poison=True)
    for _ in range(2):      # the recorded pass, then a planned one
        logits = model.forward(rng.standard_normal((4,) + model.input_shape,
                                                   dtype=np.float32))
        kept = logits.copy()
        model.backward(rng.standard_normal(logits.shape, dtype=np.float32))
        np.testing.assert_array_equal(logits, kept)
