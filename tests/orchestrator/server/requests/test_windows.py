from __future__ import annotations

import pytest
import torch

from orchestrator.server.requests.windows import Window, WindowState
from services.mesh.errors import InvalidArgument
from services.mesh.pb.omni.v1 import stage_pb2, tensor_pb2
from services.mesh.tensors import codec

D = 3  # hidden size


def segment(
    tokens: list[int], text: str = "", *, hidden: bool = True, image: bool = False
) -> stage_pb2.Segment:
    """Token t's hidden-state row is [t, t, t], so rows can be traced through splits."""
    seg = stage_pb2.Segment(request_id="r", token_ids=tokens, text_delta=text)
    if hidden and tokens:
        rows = torch.tensor(tokens, dtype=torch.float32)[:, None].expand(-1, D)
        seg.tensors.append(codec.to_proto(rows, "hidden_states"))
    if image:
        seg.tensors.append(codec.to_proto(torch.full((2, 2, 3), 7, dtype=torch.uint8), "image"))
        seg.blobs.append(tensor_pb2.Blob(name="png", media_type="image/png", data=b"\x89PNG"))
    return seg


def hidden_rows(window: Window) -> list[float]:
    by_name = {t.name: t for t in window.tensors}
    if "hidden_states" not in by_name:
        return []
    rows = codec.from_proto(by_name["hidden_states"])
    assert rows.shape[1:] == (D,)
    return rows[:, 0].tolist()


def check_rows_follow_tokens(windows: list[Window]) -> None:
    for w in windows:
        assert hidden_rows(w) == [float(t) for t in w.token_ids]


def test_full_trigger_holds_everything_until_finish() -> None:
    state = WindowState(-1)
    assert state.add(segment([1], "a")) == []
    assert state.add(segment([2, 3, 4, 5], "bc")) == []
    assert state.add(segment([6, 7], "d")) == []
    assert state.buffered == 7 and state.windows_emitted == 0
    [window] = state.finish()
    assert (window.sequence, window.is_last) == (0, True)
    assert window.token_ids == (1, 2, 3, 4, 5, 6, 7) and window.text == "abcd"
    assert [t.name for t in window.tensors] == ["hidden_states"]  # joined, not 3 pieces
    check_rows_follow_tokens([window])
    assert state.buffered == 0 and state.windows_emitted == 1


def test_window_of_one_emits_each_token_with_its_row() -> None:
    state = WindowState(1)
    out = [w for s in (segment([1], "a"), segment([2, 3, 4, 5], "b")) for w in state.add(s)]
    assert [w.token_ids for w in out] == [(1,), (2,), (3,), (4,), (5,)]
    assert [w.sequence for w in out] == [0, 1, 2, 3, 4]
    assert not any(w.is_last for w in out)
    # A segment's text goes with the window that takes its last token.
    assert [w.text for w in out] == ["a", "", "", "", "b"]
    check_rows_follow_tokens(out)
    assert state.buffered == 0
    [last] = state.finish()
    assert (last.sequence, last.is_last, last.token_ids, last.tensors) == (5, True, (), ())


def test_window_of_three_over_uneven_segments() -> None:
    state = WindowState(3)
    assert state.add(segment([1], "a")) == []
    assert state.buffered == 1
    first = state.add(segment([2, 3, 4, 5], "b"))
    assert [w.token_ids for w in first] == [(1, 2, 3)]
    assert first[0].text == "a"  # "b" waits for token 5, still buffered
    assert state.buffered == 2
    second = state.add(segment([6, 7], "c"))
    assert [w.token_ids for w in second] == [(4, 5, 6)]
    assert second[0].text == "b" and state.buffered == 1
    [last] = state.finish()
    assert (last.sequence, last.is_last, last.token_ids, last.text) == (2, True, (7,), "c")
    check_rows_follow_tokens([*first, *second, last])
    assert state.windows_emitted == 3 and state.buffered == 0


def test_one_large_segment_fills_several_windows_at_once() -> None:
    state = WindowState(2)
    out = state.add(segment([1, 2, 3, 4, 5], "xyz"))
    assert [w.token_ids for w in out] == [(1, 2), (3, 4)]
    assert [w.text for w in out] == ["", ""]
    check_rows_follow_tokens(out)
    [last] = state.finish()
    assert last.token_ids == (5,) and last.text == "xyz" and hidden_rows(last) == [5.0]


def test_a_segment_that_fits_keeps_its_tensor_objects() -> None:
    seg = segment([1, 2, 3])
    [window] = WindowState(3).add(seg)
    assert window.tensors[0] is seg.tensors[0]


def test_non_row_tensors_and_blobs_travel_whole_with_the_last_token() -> None:
    state = WindowState(2)
    [w0] = state.add(segment([1, 2, 3], "t", image=True))
    assert w0.blobs == () and [t.name for t in w0.tensors] == ["hidden_states"]
    [last] = state.finish()
    assert last.token_ids == (3,) and last.text == "t"
    assert [b.name for b in last.blobs] == ["png"]
    image = {t.name: t for t in last.tensors}["image"]
    assert list(image.shape) == [2, 2, 3]
    assert codec.from_proto(image).eq(7).all()


def test_segments_with_only_tensors_count_as_one_item() -> None:
    state = WindowState(1)
    [w0] = state.add(segment([], "img", hidden=False, image=True))
    assert state.windows_emitted == 1 and w0.token_ids == ()
    assert w0.text == "img" and [b.name for b in w0.blobs] == ["png"]
    [w1] = state.add(segment([], hidden=False, image=True))
    assert w1.sequence == 1

    pair = WindowState(2)
    assert pair.add(segment([], hidden=False, image=True)) == []
    assert pair.buffered == 1
    [both] = pair.add(segment([], hidden=False, image=True))
    # Same-name tensors in one window are joined along the first dim.
    assert [list(t.shape) for t in both.tensors] == [[4, 2, 3]] and len(both.blobs) == 2


def test_text_without_tokens_rides_with_the_next_window() -> None:
    state = WindowState(2)
    assert state.add(segment([], "hello ", hidden=False)) == []
    assert state.buffered == 0
    [window] = state.add(segment([1, 2], "world"))
    assert window.text == "hello world"


def test_empty_upstream_still_gets_a_last_window() -> None:
    for size in (-1, 1, 4):
        state = WindowState(size)
        [last] = state.finish()
        assert last == Window(0, True, (), "", (), ())


def test_a_final_segment_with_only_text_lands_in_the_last_window() -> None:
    state = WindowState(2)
    state.add(segment([1, 2]))
    state.add(segment([], "!", hidden=False))
    [last] = state.finish()
    assert (last.sequence, last.token_ids, last.text) == (1, (), "!")


def test_a_tensor_that_lies_about_its_size_is_refused() -> None:
    seg = segment([1, 2])
    seg.tensors[0].raw = seg.tensors[0].raw[:-4]
    with pytest.raises(InvalidArgument) as err:
        WindowState(1).add(seg)
    assert err.value.field == "segment.tensors.hidden_states"


def test_misuse_is_refused() -> None:
    with pytest.raises(ValueError, match="window"):
        WindowState(0)
    state = WindowState(1)
    state.finish()
    with pytest.raises(RuntimeError):
        state.add(segment([1]))
    with pytest.raises(RuntimeError):
        state.finish()


def _shm_segment(rows: int, name: str = "omni-default-1-1") -> stage_pb2.Segment:
    segment = stage_pb2.Segment(request_id="r", token_ids=list(range(rows)))
    tensor = segment.tensors.add(name="hidden_states", dtype="float32", shape=[rows, 2])
    tensor.shm.name = name
    tensor.shm.nbytes = rows * 8
    return segment


def test_shm_rows_are_split_as_narrower_views_of_the_same_block() -> None:
    state = WindowState(1)
    windows = state.add(_shm_segment(3))
    refs = [w.tensors[0].shm for w in windows]
    assert [(r.name, r.offset, r.nbytes) for r in refs] == [
        ("omni-default-1-1", 0, 8),
        ("omni-default-1-1", 8, 8),
        ("omni-default-1-1", 16, 8),
    ]
    assert all(list(w.tensors[0].shape) == [1, 2] for w in windows)


def test_refs_are_not_joined_but_travel_as_ordered_pieces() -> None:
    state = WindowState(-1)
    state.add(_shm_segment(2, "omni-default-1-1"))
    state.add(_shm_segment(1, "omni-default-1-2"))
    (window,) = state.finish()
    assert [t.shm.name for t in window.tensors] == ["omni-default-1-1", "omni-default-1-2"]
    assert [t.name for t in window.tensors] == ["hidden_states", "hidden_states"]


def test_a_first_window_smaller_than_the_rest() -> None:
    state = WindowState(4, first_window=2)
    out = [w for t in range(1, 12) for w in state.add(segment([t]))]
    out += state.finish()
    assert [w.token_ids for w in out] == [(1, 2), (3, 4, 5, 6), (7, 8, 9, 10), (11,)]
    assert [w.sequence for w in out] == [0, 1, 2, 3] and out[-1].is_last
    check_rows_follow_tokens(out)


def test_a_first_window_needs_a_window_of_n() -> None:
    with pytest.raises(ValueError, match="first_window"):
        WindowState(-1, first_window=2)
    with pytest.raises(ValueError, match="first_window"):
        WindowState(4, first_window=0)
