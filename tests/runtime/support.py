"""Helpers of the runtime tests: inputs, a relay that records and rewrites frames, protocols."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from uuid import uuid4

import numpy as np
from flwr.app import Context, Error, Message, RecordDict
from flwr.common.constant import ErrorCode
from flwr.common.serde import (
    message_from_proto,
    message_to_proto,
)
from flwr.serverapp import Grid

from fedfm.flower.apps import parse_node_config
from fedfm.protocols.masked_sum import masked_sum
from fedfm.runtime import (
    InProcessFederation,
    KeyBundle,
    Protocol,
    RoleContext,
    Step,
)
from fedfm.runtime.messages import (
    bundle_from_config,
    bundle_to_config,
    frames_from_arrays,
    frames_to_arrays,
)
from fedfm.runtime.transport import Envelope, Failure, Transport
from fedfm_clients.masked_sum import app as masked_sum_client

ROOT = Path(__file__).resolve().parents[2]


DEMO = ROOT / "simulations" / "runtime_demo"


def inputs(length: int = 64, seed: int = 0) -> dict[str, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return {role: {"x": rng.integers(-(2**40), 2**40, length)} for role in ("alice", "bob")}


class Relay:
    """A transport in the relay's seat: it records every envelope it handles, both ways, and
    may rewrite requests on their way to a node (a relay that tampers)."""

    def __init__(
        self, inner: Transport, rewrite: Callable[[Envelope], Envelope] | None = None
    ) -> None:
        self.inner, self.rewrite = inner, rewrite
        self.handled: list[Envelope] = []

    def send_and_receive(
        self, envelopes: Iterable[Envelope], *, timeout: float | None = None
    ) -> list[Envelope | Failure]:
        envelopes = [self.rewrite(e) if self.rewrite else e for e in envelopes]
        replies = self.inner.send_and_receive(envelopes, timeout=timeout)
        self.handled += envelopes + [r for r in replies if isinstance(r, Envelope)]
        return replies

    def seen(self) -> bytes:
        """Every byte of every array and config value the relay handled."""
        parts = []
        for envelope in self.handled:
            parts += [array.tobytes() for array in envelope.arrays.values()]
            parts += [
                str(v).encode() if not isinstance(v, bytes) else v for v in envelope.config.values()
            ]
        return b"\x00".join(parts)


def rewrite_frames(step: str, node: int, change: Callable[[list[bytes]], list[bytes]]):
    """A relay rewrite that changes the frames of ``step``'s request to ``node``."""

    def rewrite(envelope: Envelope) -> Envelope:
        if envelope.config.get("runtime.step") != step or envelope.node_id != node:
            return envelope
        arrays = {k: v for k, v in envelope.arrays.items() if not k.startswith("frame.")}
        arrays |= frames_to_arrays(change(frames_from_arrays(envelope.arrays)))
        return replace(envelope, arrays=arrays)

    return rewrite


def windows(data: bytes, width: int = 32) -> list[bytes]:
    return [data[i : i + width] for i in range(0, len(data) - width + 1, 8)]


def run_with(
    rewrite: Callable[[Envelope], Envelope], federation: InProcessFederation | None = None
):
    federation = federation or InProcessFederation(masked_sum(), inputs(length=8))
    return federation.run(Relay(federation.transport(), rewrite))


def flip_last_byte(frames: list[bytes]) -> list[bytes]:
    return [frames[0][:-1] + bytes([frames[0][-1] ^ 1]), *frames[1:]]


def talk(context: RoleContext) -> None:
    said = context.input("words")
    context.state["said"] = said
    for word in said:
        context.send("listener", {"word": np.array(word)})


def listen(context: RoleContext) -> None:
    heard = np.array([m.arrays["word"] for m in context.inbox if m.sender == "speaker"])
    context.send("speaker", {"heard": heard})


def check(context: RoleContext) -> None:
    heard = context.receive("listener")["heard"]
    context.publish("faithful", np.array(np.array_equal(heard, context.state["said"])))


def chatter(**parameters) -> Protocol:
    """Two roles; several frames on one channel, state kept between a role's steps."""
    return Protocol(
        name="chatter",
        roles=("speaker", "listener"),
        channels=(("speaker", "listener"),),
        steps=(
            Step("talk", ("speaker",), talk),
            Step("listen", ("listener",), listen),
            Step("check", ("speaker",), check),
        ),
        parameters=parameters,
    )


WORDS = {"speaker": {"words": np.arange(3)}}


def substitute(bundle_index: int, forge: Callable[[KeyBundle, bytes], KeyBundle]):
    """A relay rewrite that replaces one bundle of every roster it hands out by
    ``forge(bundle, session)`` (the session id is in every request: the relay knows it)."""

    def rewrite(envelope: Envelope) -> Envelope:
        prefix = f"roster.{bundle_index}"
        if f"{prefix}.roles" not in envelope.config:
            return envelope
        bundle = bundle_from_config(envelope.config, prefix)
        forged = forge(bundle, envelope.config["runtime.session"])
        return replace(envelope, config=envelope.config | bundle_to_config(forged, prefix))

    return rewrite


def noop(context: RoleContext) -> None:
    del context


def load_demo():
    """``simulations/runtime_demo/run.py`` (its workspace preparation)."""
    spec = importlib.util.spec_from_file_location("runtime_demo_run", DEMO / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def wire(message: Message) -> Message:
    """The message as the receiving end gets it (Flower's protobuf form and back)."""
    return message_from_proto(message_to_proto(message))


class LoopbackGrid(Grid):
    """Delivers every message to its node's ClientApp in this process, in Flower's wire form,
    and keeps the wire bytes of everything it carried (the relay's view). ``client_app``:
    the masked-sum demo's unless given."""

    def __init__(self, contexts: dict[int, Context], rewrite=None, client_app=None) -> None:
        self.contexts, self.rewrite = contexts, rewrite or (lambda message: message)
        self.client_app = client_app or masked_sum_client
        self.replies: dict[str, Message] = {}
        self.carried: list[bytes] = []

    def get_node_ids(self) -> list[int]:
        return list(self.contexts)

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        ids = []
        for message in messages:
            message.metadata.__dict__["_message_id"] = uuid4().hex  # as Flower's InMemoryGrid
            received = wire(self.rewrite(message))
            self.carried.append(message_to_proto(received).SerializeToString())
            try:
                reply = self.client_app(received, self.contexts[received.metadata.dst_node_id])
            except Exception as error:  # Flower's runtimes turn these into error replies
                reply = Message(
                    Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, str(error)), reply_to=received
                )
            reply = wire(reply)
            self.carried.append(message_to_proto(reply).SerializeToString())
            self.replies[received.metadata.message_id] = reply
            ids.append(received.metadata.message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        return [self.replies.pop(i) for i in message_ids if i in self.replies]

    def _unused(self, *_, **__):
        raise NotImplementedError

    set_run = create_message = send_and_receive = _unused
    run = property(_unused)


def flower_contexts(run_config: dict[str, str], node_config: str = "") -> dict[int, Context]:
    """Three simulated nodes' contexts; ``node_config`` (``key=value`` pairs) is every node's
    own config, as ``$FEDFM_NODE_CONFIG`` gives it to simulated nodes."""
    own = parse_node_config(node_config)
    # node ids unrelated to the partitions, as in Flower
    return {
        9000 - 17 * k: Context(
            run_id=1,
            node_id=9000 - 17 * k,
            node_config={"partition-id": k, "num-partitions": 3, **own},
            state=RecordDict(),
            run_config=run_config,
        )
        for k in range(3)
    }


def demo_inputs(workspace: Path) -> dict[str, dict[str, np.ndarray]]:
    return {
        role: {"x": np.load(workspace / "inputs" / f"{role}.npz")["x"]} for role in ("alice", "bob")
    }
