"""serve's dynamic batching, without Ray: who gets which answer, how batches form, errors."""

import asyncio

import numpy as np
import pytest

from imgtrain.inference.batcher import Batcher


class SlowModel:
    """Doubles its input; each call takes a while (the event loop runs meanwhile) and is recorded."""

    def __init__(self, seconds=0.02, fail=False):
        self.calls, self.seconds, self.fail = [], seconds, fail

    async def __call__(self, images: np.ndarray) -> np.ndarray:
        self.calls.append(len(images))
        await asyncio.sleep(self.seconds)
        if self.fail:
            raise RuntimeError("the model failed")
        return images.reshape(len(images), -1).astype(np.float32) * 2


def test_concurrent_requests_each_get_their_own_row_in_few_forward_passes():
    async def scenario():
        model = SlowModel()
        batcher = Batcher(model, max_size=8, wait_s=0)
        images = [np.full((2, 2, 1), k, np.uint8) for k in range(20)]
        answers = await asyncio.gather(*(batcher(im) for im in images))
        return model.calls, answers

    calls, answers = asyncio.run(scenario())
    for k, row in enumerate(answers):
        assert row.tolist() == [2.0 * k] * 4
    assert sum(calls) == 20 and max(calls) <= 8
    assert calls == [8, 8, 4]  # all arrived together: full batches, the rest in one more


def test_a_lone_request_waits_at_most_the_batch_wait_and_late_ones_join_the_next_batch():
    async def scenario():
        model = SlowModel(seconds=0.01)
        batcher = Batcher(model, max_size=8, wait_s=0.05)
        first = asyncio.ensure_future(batcher(np.zeros((1, 1, 1), np.uint8)))
        await asyncio.sleep(0.01)  # within the wait: joins the first one's batch
        second = asyncio.ensure_future(batcher(np.ones((1, 1, 1), np.uint8)))
        await asyncio.gather(first, second)
        return model.calls, first.result(), second.result()

    calls, first, second = asyncio.run(scenario())
    assert calls == [2] and first.tolist() == [0.0] and second.tolist() == [2.0]


def test_a_failed_forward_pass_fails_its_requests_and_the_batcher_goes_on():
    async def scenario():
        model = SlowModel(fail=True)
        batcher = Batcher(model, max_size=4, wait_s=0)
        results = await asyncio.gather(*(batcher(np.zeros((1, 1, 1), np.uint8)) for _ in range(3)),
                                       return_exceptions=True)
        model.fail = False
        return results, await batcher(np.ones((1, 1, 1), np.uint8))

    results, after = asyncio.run(scenario())
    assert all(isinstance(r, RuntimeError) for r in results)
    assert after.tolist() == [2.0]


def test_a_request_that_gave_up_is_left_out_of_the_next_batch():
    async def scenario():
        model = SlowModel(seconds=0.05)
        batcher = Batcher(model, max_size=8, wait_s=0)
        running = asyncio.ensure_future(batcher(np.zeros((1, 1, 1), np.uint8)))
        await asyncio.sleep(0.01)  # the first batch is running; these two queue behind it
        gave_up = asyncio.ensure_future(asyncio.wait_for(batcher(np.ones((1, 1, 1), np.uint8)), 0.01))
        kept = asyncio.ensure_future(batcher(np.ones((1, 1, 1), np.uint8)))
        with pytest.raises(asyncio.TimeoutError):
            await gave_up
        await asyncio.gather(running, kept)
        return model.calls

    assert asyncio.run(scenario()) == [1, 1]
