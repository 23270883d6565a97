"""The benchmarks' follow-up users (benchmarks/workloads.py): each conversation grows turn by turn, and the
users start again from their openings at different times."""

from benchmarks.workloads import FOLLOW_UP_TURNS, UserRequests, make_workload


def restarts(user: int, requests: int) -> list[int]:
    """The numbers of `user`'s requests that went back to its opening (their prompt: opening and question)."""
    conversation = UserRequests(make_workload("follow-up"), user)
    conversation.open(lambda messages: "the answer to the opening")
    went_back = []
    for number in range(1, requests + 1):
        messages = conversation.next_messages()
        if len(messages) == 3 and number > 1:
            went_back.append(number)
        conversation.answered(f"answer {number}")
    return went_back


def test_a_follow_up_conversation_grows_by_each_turn_and_its_answer():
    conversation = UserRequests(make_workload("follow-up"), FOLLOW_UP_TURNS - 1)
    conversation.open(lambda messages: "the answer to the opening")
    for turn in range(1, FOLLOW_UP_TURNS + 1):
        messages = conversation.next_messages()
        assert len(messages) == 2 * turn + 1
        assert [m["role"] for m in messages[-2:]] == ["assistant", "user"]
        conversation.answered(f"answer {turn}")
    assert conversation.opening[1]["content"][0]["text"] == "the answer to the opening"


def test_users_start_again_at_different_times_then_every_round():
    firsts = [restarts(user, 3 * FOLLOW_UP_TURNS)[0] for user in range(FOLLOW_UP_TURNS)]
    assert sorted(firsts) == list(range(2, FOLLOW_UP_TURNS + 2))  # one user at each request number
    for user in (0, 7, 13):
        went_back = restarts(user, 3 * FOLLOW_UP_TURNS)
        assert all(b - a == FOLLOW_UP_TURNS for a, b in zip(went_back, went_back[1:])), went_back


def test_each_follow_up_user_has_an_image_file_of_its_own_with_the_same_pixels():
    """So that the app's caches, which know a file by its path or its bytes, see 200 users' 200 photos."""
    import numpy as np
    from PIL import Image

    workload = make_workload("follow-up")
    paths = [workload.opening_turn(user)["content"][0]["path"] for user in (1, 2)]
    data = [open(path, "rb").read() for path in [workload.media["path"], *paths]]
    assert len(set(paths)) == 2 and len(set(data)) == 3
    pixels = [np.asarray(Image.open(path).convert("RGB")) for path in [workload.media["path"], *paths]]
    assert all((p == pixels[0]).all() for p in pixels[1:])
