"""Hypothesis strategies: control states reached by random sequences of changes."""

from __future__ import annotations

from hypothesis import strategies as st

from logbroker.controlplane import (
    AclGrant,
    ControlPlaneError,
    SegmentMeta,
    SegmentState,
    User,
)
from logbroker.controlplane._state import (
    Change,
    CommitGroupPosition,
    ControlState,
    CreateTopic,
    CreateUser,
    DeleteSegment,
    DeleteUser,
    GrantAcl,
    PutSegment,
    RevokeAcl,
    UpdateUser,
)
from tests.unit.controlplane.helpers import make_topic

TOPICS = ["orders", "audit", "a.b"]
USERS = ["alice", "bob", "app@eu"]
#: Any text at all, lone surrogates and characters beyond the BMP included.
ANY_TEXT = st.text(st.characters(exclude_categories=()), max_size=12)


@st.composite
def _create_topic(draw: st.DrawFn) -> Change:
    bits = draw(st.integers(0, 8))
    topic, ranges = make_topic(
        draw(st.sampled_from(TOPICS)), ranges=draw(st.integers(1, min(4, 1 << bits))), bits=bits
    )
    return CreateTopic(topic, tuple(ranges))


@st.composite
def _put_segment(draw: st.DrawFn) -> Change:
    state = draw(st.sampled_from(SegmentState))
    sealed = state is SegmentState.SEALED
    return PutSegment(
        SegmentMeta(
            f"{draw(st.sampled_from(TOPICS))}.{draw(st.integers(0, 1))}",
            draw(st.sampled_from([0, 100, 2**40])),
            state,
            draw(st.integers(0, 2**40)) if sealed else None,
            draw(st.integers(0, 2**33)) if sealed else None,
            tuple(
                draw(
                    st.lists(
                        st.sampled_from(["n1", "n2", "n3"]), min_size=1, max_size=3, unique=True
                    )
                )
            ),
            draw(st.integers(0, 3)),
        )
    )


_grants = st.builds(
    AclGrant,
    st.sampled_from(USERS),
    st.sampled_from(["produce", "consume"]),
    st.sampled_from(["orders", "orders.*", "a.b"]),
)
_permissions = st.frozensets(st.sampled_from(["admin", "produce", "consume"]))
_create_user = st.builds(
    CreateUser, st.builds(User, st.sampled_from(USERS), ANY_TEXT, _permissions)
)

CHANGES: st.SearchStrategy[Change] = st.one_of(
    _create_topic(),
    _put_segment(),
    st.builds(DeleteSegment, st.sampled_from(["orders.0", "a.b.1"]), st.sampled_from([0, 100])),
    _create_user,
    st.builds(
        UpdateUser,
        st.sampled_from(USERS),
        st.none() | ANY_TEXT,
        st.none() | _permissions,
    ),
    st.builds(DeleteUser, st.sampled_from(USERS)),
    st.builds(GrantAcl, _grants),
    st.builds(RevokeAcl, _grants),
    st.builds(
        CommitGroupPosition,
        st.sampled_from(TOPICS),
        st.text(st.characters(exclude_categories=()), min_size=1, max_size=8),
        ANY_TEXT,
    ),
)


def apply_all(state: ControlState, changes: list[Change]) -> ControlState:
    """Apply each change that fits the state so far; skip the others."""
    for change in changes:
        try:
            state = change.apply(state)
        except ControlPlaneError:
            continue
    return state


#: Topics and users first, so that the changes after them mostly apply.
CHANGE_LISTS = st.tuples(
    st.lists(_create_topic(), min_size=1, max_size=3),
    st.lists(_create_user, min_size=1, max_size=3),
    st.lists(CHANGES, min_size=5, max_size=30),
).map(lambda lists: [change for changes in lists for change in changes])


def states() -> st.SearchStrategy[ControlState]:
    return CHANGE_LISTS.map(lambda changes: apply_all(ControlState(), changes))
