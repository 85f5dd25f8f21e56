"""Homomorphic arithmetic on SEAL ciphertexts with level tracking and client-assisted refreshes.

The CKKS evaluator works on ``tenseal.sealapi`` ciphertexts directly: TenSEAL's ``CKKSVector``
rescales after every product and cannot rotate by chosen steps. A :class:`Circuit` keeps every
ciphertext at the scale ``2**scale_bits``: a plaintext factor is encoded at the scale of the
prime the product is then divided by, so a product of a ciphertext and a plaintext keeps the
scale exactly; after a ciphertext x ciphertext product the scale is reset to ``2**scale_bits``
(a relative error below ``1e-7`` since the primes lie that close to ``2**scale_bits``). Sums of
products are computed lazily: products of one sum are added before a single relinearisation and
rescale.

Depth. A ciphertext's *headroom* is the number of rescales left before it reaches the refresh
level (the chain's first two or three primes, kept for the mask: :mod:`fedfm.crypto.refresh`). An
operation that needs a level from an operand without headroom first refreshes it. Refreshing
needs the data owner, so every method that may refresh is a generator (a :data:`Work`): it yields
a list of masked ciphertexts, is sent back the data owner's fresh ones, and returns its result.
:func:`~fedfm.crypto.backend.lockstep` advances several works together so that their refreshes
travel in one round trip.

Polynomials are traced (:class:`Traced`) through the same evaluators the plaintext model uses
(:mod:`fedfm.approx.evaluate`), then executed here: one source of truth for every coefficient and
iteration.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import numpy as np
import tenseal as ts
import tenseal.sealapi as sealapi

from fedfm.crypto.backend import Work, drive
from fedfm.crypto.rns_linear import linear_map
from fedfm.crypto.schedule import LevelCircuit, LevelStats, choose_refresh, last_uses, short
from fedfm.crypto.seal_raw import SealIO, dumps
from fedfm.crypto.workers import CONTEXTS_PER_WORKER
from fedfm.errors import CryptoParameterError, ProtocolError

Ciphertext = Any  # sealapi.Ciphertext (TenSEAL registers it under its own module)
R = TypeVar("R")
_LOG = logging.getLogger(__name__)


class SegmentRunner(Protocol):
    """What :meth:`Circuit.spread` needs of a worker pool: run a module-level function in
    another process. The evaluator injects one (``fedfm.crypto.workers.WorkerPool``)."""

    def submit(self, function: Callable[..., Any], *args: Any) -> Future[Any]: ...


@dataclass
class CircuitStats:
    """Operation counts of one circuit (reported by benchmarks)."""

    refreshes: int = 0
    refreshed_ciphertexts: int = 0
    rotations: int = 0
    products: int = 0
    plain_products: int = 0
    places: list[str] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)

    @contextmanager
    def timing(self, what: str) -> Iterator[None]:
        """Add the time spent inside the block to ``seconds[what]`` (where the time goes)."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[what] = self.seconds.get(what, 0.0) + time.perf_counter() - started

    def operations(self) -> dict[str, Any]:
        """Operation counts and seconds (what a worker's segment reports back to :meth:`merge`)."""
        return {
            "rotations": self.rotations,
            "products": self.products,
            "plain_products": self.plain_products,
            "seconds": dict(self.seconds),
        }

    def merge(self, operations: dict[str, Any]) -> None:
        """Add the operations of a segment evaluated elsewhere."""
        self.rotations += operations["rotations"]
        self.products += operations["products"]
        self.plain_products += operations["plain_products"]
        for what, spent in operations["seconds"].items():
            self.seconds[what] = self.seconds.get(what, 0.0) + spent


def _timed(category: str) -> Any:
    """Count the time a method of a :class:`Circuit` (or :class:`ProductSum`) takes."""

    def wrap(method: Any) -> Any:
        @functools.wraps(method)
        def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
            circuit = self if isinstance(self, Circuit) else self.circuit
            with circuit.stats.timing(category):
                return method(self, *args, **kwargs)

        return timed

    return wrap


class Circuit:
    """SEAL operations on one data owner's ciphertexts, from its *public* TenSEAL context."""

    def __init__(self, context: ts.Context, refresher: Any, refresh_index: int = 1) -> None:
        if context.is_private():
            raise CryptoParameterError("the evaluating circuit must not hold a secret key")
        self.seal = context.seal_context().data
        self.evaluator = sealapi.Evaluator(self.seal)
        self.encoder = sealapi.CKKSEncoder(self.seal)
        self.relin_keys = context.relin_keys().data
        self.galois_keys = context.galois_keys().data if context.has_galois_keys() else None
        self.scale = float(context.global_scale)
        self.slots = self.encoder.slot_count()
        self.refresher = refresher
        # SEAL chain index of the refresh level (the refresher's, when it has one)
        self.refresh_index = int(getattr(refresher, "refresh_index", refresh_index))
        self.stats = CircuitStats()
        self._vectors: dict[tuple[Any, ...], Any] = {}
        self._steps: list[int] = []
        self._io: SealIO | None = None
        # Set by the evaluator to spread segments over worker processes (spread).
        self.pool: SegmentRunner | None = None
        self.context_path: str | None = None

    @property
    def io(self) -> SealIO:
        """Raw access to this context's ciphertexts (made on first use)."""
        if self._io is None:
            self._io = SealIO(self.seal)
        return self._io

    def spread(
        self, function: Callable[..., R], inputs: Sequence[Sequence[Any]], **options: Any
    ) -> list[R]:
        """``[function(self, *args, **options) for args in inputs]`` for independent segments
        that need no refresh: the first here, the others in the worker pool if there is one
        (:func:`run_segment`), with the same results.

        ``function`` must be a module-level function (workers import it by name) returning
        nested lists of ciphertexts; ``options`` must be picklable.
        """
        if self.pool is None or self.context_path is None or len(inputs) < 2:
            return [function(self, *args, **options) for args in inputs]
        hold = getattr(self.refresher, "hold_material", None)
        if hold is not None:
            hold()  # segments must not queue behind mask material
        futures = [self._submit_segment(function, args, options) for args in inputs[1:]]
        out = [function(self, *inputs[0], **options)]
        for args, future in zip(inputs[1:], futures, strict=True):
            done = None
            if future is not None:
                try:
                    done = future.result()
                except BrokenProcessPool as error:
                    self._drop_pool(error)
            if done is None:
                out.append(function(self, *args, **options))
                continue
            result, operations = done
            self.stats.merge(operations)
            out.append(decode_nested(self.io, result))
        resume = getattr(self.refresher, "resume_material", None)
        if resume is not None:
            resume()
        return out

    def _submit_segment(
        self, function: Callable[..., Any], args: Sequence[Any], options: dict[str, Any]
    ) -> Future[Any] | None:
        """The segment's future in the pool, or ``None`` (evaluate here) if there is none."""
        if self.pool is None or self.context_path is None:
            return None
        try:
            return self.pool.submit(
                run_segment,
                self.context_path,
                self._steps,
                function,
                [encode_nested(item) for item in args],
                options,
                self.refresh_index,
            )
        except BrokenProcessPool as error:
            self._drop_pool(error)
            return None

    def _drop_pool(self, error: BrokenProcessPool) -> None:
        if self.pool is not None:
            _LOG.warning("segment workers failed (%s); evaluating in-process", error)
        self.pool = None  # a broken pool does not come back

    # -- levels ----------------------------------------------------------------------------------
    @property
    def full_headroom(self) -> int:
        """Headroom of a freshly refreshed ciphertext (refreshes return the top data level)."""
        return int(self.seal.first_context_data().chain_index()) - self.refresh_index

    def headroom(self, ct: Ciphertext) -> int:
        """Rescales left before ``ct`` reaches the refresh level."""
        return self.seal.get_context_data(ct.parms_id()).chain_index() - self.refresh_index

    def _last_prime(self, ct: Ciphertext) -> int:
        data = self.seal.get_context_data(ct.parms_id())
        return int(data.parms().coeff_modulus()[-1].value())

    def _require(self, ct: Ciphertext) -> None:
        if self.headroom(ct) < 1:
            raise ProtocolError("internal: a ciphertext without headroom reached a product")

    def align(self, cts: Sequence[Ciphertext]) -> list[Ciphertext]:
        """The ciphertexts switched (without rescaling) down to the lowest level among them."""
        lowest = min(cts, key=self.headroom)
        target = lowest.parms_id()
        out = []
        for ct in cts:
            if ct.parms_id() != target:
                ct = self._out(self.evaluator.mod_switch_to, ct, target)
            out.append(ct)
        return out

    # -- refreshes -------------------------------------------------------------------------------
    def refresh(self, cts: list[Ciphertext], place: str) -> Work[list[Ciphertext]]:
        """Masked client-assisted refresh of ``cts`` (one round trip)."""
        with self.stats.timing("refresh masks"):
            pairs = self.refresher.mask_many(cts)
        masks = [mask for _, mask in pairs]
        fresh = yield [hidden for hidden, _ in pairs]
        with self.stats.timing("refresh masks"):
            out = self.refresher.unmask_many(fresh, masks)
        self.stats.refreshes += 1
        self.stats.refreshed_ciphertexts += len(cts)
        self.stats.places.append(f"{place}:{len(cts)}")
        return out

    def ensure(
        self, tensors: list[list[Ciphertext]], levels: int, place: str
    ) -> Work[list[list[Ciphertext]]]:
        """``tensors`` with every ciphertext of less than ``levels`` headroom refreshed.

        All of them travel in one round trip; a tensor is refreshed whole (its ciphertexts are
        usually at one level) so that its parts stay aligned.
        """
        low = [i for i, cts in enumerate(tensors) if any(self.headroom(c) < levels for c in cts)]
        if not low:
            return tensors
        flat = [ct for i in low for ct in tensors[i]]
        fresh = yield from self.refresh(flat, place)
        out = list(tensors)
        offset = 0
        for i in low:
            out[i] = fresh[offset : offset + len(tensors[i])]
            offset += len(tensors[i])
        return out

    # -- plaintexts ------------------------------------------------------------------------------
    def _scalar(self, value: float, ct: Ciphertext, scale: float) -> Any:
        plain = sealapi.Plaintext()
        self.encoder.encode(float(value), ct.parms_id(), scale, plain)
        return plain

    def _vector(self, key: Any, vector: np.ndarray, ct: Ciphertext, scale: float) -> Any:
        """``vector`` encoded for ``ct``'s level; cached under ``key`` unless it is ``None``."""
        cache_key = (key, tuple(ct.parms_id()), scale)
        plain = None if key is None else self._vectors.get(cache_key)
        if plain is None:
            plain = sealapi.Plaintext()
            values = np.asarray(vector, dtype=np.float64).tolist()
            self.encoder.encode(values, ct.parms_id(), scale, plain)
            if key is not None:
                self._vectors[cache_key] = plain
        return plain

    def forget_vectors(self, drop: Callable[[Any], bool]) -> None:
        """Remove the cached plaintexts whose key ``drop`` selects (one-off masks, e.g. a
        permutation's, that would otherwise stay for the circuit's lifetime)."""
        for cache_key in [k for k in self._vectors if drop(k[0])]:
            del self._vectors[cache_key]

    def _out(self, operation: Any, *args: Any) -> Ciphertext:
        """Run a SEAL evaluator operation that writes into a new ciphertext."""
        result = sealapi.Ciphertext(self.seal)
        operation(*args, result)
        return result

    def _rescale(self, ct: Ciphertext) -> Ciphertext:
        self.evaluator.rescale_to_next_inplace(ct)
        ct.scale = self.scale
        return ct

    # -- arithmetic ------------------------------------------------------------------------------
    def add(self, a: Ciphertext, b: Ciphertext) -> Ciphertext:
        a, b = self.align([a, b])
        return self._out(self.evaluator.add, a, b)

    def sub(self, a: Ciphertext, b: Ciphertext) -> Ciphertext:
        a, b = self.align([a, b])
        return self._out(self.evaluator.sub, a, b)

    def add_scalar(self, ct: Ciphertext, value: float) -> Ciphertext:
        return self._out(self.evaluator.add_plain, ct, self._scalar(value, ct, ct.scale))

    def add_vector(self, ct: Ciphertext, key: Any, vector: np.ndarray) -> Ciphertext:
        return self._out(self.evaluator.add_plain, ct, self._vector(key, vector, ct, ct.scale))

    def negate(self, ct: Ciphertext) -> Ciphertext:
        return self._out(self.evaluator.negate, ct)

    @_timed("plaintext products")
    def weighted_sum(
        self, terms: Sequence[tuple[Ciphertext, float]], bias: float = 0.0
    ) -> Ciphertext:
        """``sum_i w_i x_i + bias`` (one level): products summed before one rescale."""
        # A zero plaintext factor would make SEAL refuse a transparent product.
        kept = [(ct, w) for ct, w in terms if abs(w) > 1e-12]
        if not kept:
            raise ProtocolError("a weighted sum with all weights zero has no ciphertext result")
        cts = self.align([ct for ct, _ in kept])
        prime = float(self._last_prime(cts[0]))
        total = None
        for ct, (_, weight) in zip(cts, kept, strict=True):
            self._require(ct)
            product = self._out(self.evaluator.multiply_plain, ct, self._scalar(weight, ct, prime))
            if total is None:
                total = product
            else:
                self.evaluator.add_inplace(total, product)
        self.stats.plain_products += len(kept)
        total = self._rescale(total)
        return self.add_scalar(total, bias) if bias else total

    @_timed("plaintext products")
    def linear(
        self, cts: Sequence[Ciphertext], weight: np.ndarray, bias: np.ndarray
    ) -> list[Ciphertext]:
        """``[sum_i weight[o, i] cts[i] + bias[o] for o]`` (one level) as exact integer matrix
        products in BLAS (:mod:`fedfm.crypto.rns_linear`) instead of one SEAL product per weight.
        """
        weight = np.asarray(weight, dtype=np.float64)
        if not np.all(np.any(weight != 0, axis=1)):
            raise ProtocolError("a weighted sum with all weights zero has no ciphertext result")
        cts = self.align(list(cts))
        for ct in cts:
            self._require(ct)
        products = linear_map(self.io, self.seal, cts, weight)
        self.stats.plain_products += weight.size
        out = []
        for product, offset in zip(products, np.asarray(bias, dtype=np.float64), strict=True):
            product = self._rescale(product)
            out.append(self.add_scalar(product, float(offset)) if offset else product)
        return out

    @_timed("plaintext products")
    def masked_sum(self, terms: Sequence[tuple[Ciphertext, Any, np.ndarray]]) -> Ciphertext:
        """``sum_i x_i * m_i`` for plaintext slot vectors ``m_i`` (cached by key; one level)."""
        terms = [term for term in terms if np.any(term[2])]
        if not terms:
            raise ProtocolError("a masked sum with all masks zero has no ciphertext result")
        cts = self.align([ct for ct, _, _ in terms])
        prime = float(self._last_prime(cts[0]))
        total = None
        for ct, (_, key, vector) in zip(cts, terms, strict=True):
            self._require(ct)
            product = self._out(
                self.evaluator.multiply_plain, ct, self._vector(key, vector, ct, prime)
            )
            if total is None:
                total = product
            else:
                self.evaluator.add_inplace(total, product)
        self.stats.plain_products += len(terms)
        return self._rescale(total)

    def product_sum(self, pairs: Sequence[tuple[Ciphertext, Ciphertext]]) -> Ciphertext:
        """``sum_i a_i * b_i`` of ciphertexts: one relinearisation and one rescale in all."""
        total = ProductSum(self)
        for a, b in pairs:
            total.add(a, b)
        return total.result()

    def multiply(self, a: Ciphertext, b: Ciphertext) -> Ciphertext:
        return self.product_sum([(a, b)])

    def scale_by(self, ct: Ciphertext, value: float) -> Ciphertext:
        return self.weighted_sum([(ct, value)])

    # -- rotations -------------------------------------------------------------------------------
    def declare_steps(self, steps: Sequence[int]) -> None:
        """Use the rotation keys for ``steps``; refuse a public context that lacks any of them."""
        tool = self.seal.key_context_data().galois_tool()
        missing = [
            step
            for step in steps
            if self.galois_keys is None
            or not self.galois_keys.has_key(tool.get_elt_from_step(step))
        ]
        if missing:
            raise CryptoParameterError(
                f"public context lacks rotation keys for steps {missing}; the data owner must "
                "create it for this model's slot layout"
            )
        self._steps = sorted(set(steps))

    @_timed("rotations")
    def rotate(self, ct: Ciphertext, steps: int) -> Ciphertext:
        """``ct`` rotated left by ``steps`` slots (right if negative), composing keyed steps."""
        if steps == 0:
            return ct
        if steps in self._steps:
            self.stats.rotations += 1
            return self._out(self.evaluator.rotate_vector, ct, steps, self.galois_keys)
        # Greedy decomposition into keyed steps of the same sign (powers of two).
        same_sign = sorted((s for s in self._steps if s * steps > 0), key=abs)
        remaining = steps
        out = ct
        for step in reversed(same_sign):
            while abs(remaining) >= abs(step) and remaining * step > 0:
                out = self._out(self.evaluator.rotate_vector, out, step, self.galois_keys)
                self.stats.rotations += 1
                remaining -= step
        if remaining:
            raise CryptoParameterError(f"no rotation keys compose a rotation by {steps} slots")
        return out


class ProductSum:
    """A sum of ciphertext products built term by term (so operands can be made and dropped one
    at a time), relinearised and rescaled once by :meth:`result`."""

    def __init__(self, circuit: Circuit) -> None:
        self.circuit = circuit
        self.total: Ciphertext | None = None

    @_timed("ciphertext products")
    def add(self, a: Ciphertext, b: Ciphertext) -> None:
        circuit = self.circuit
        operands = [a, b] if self.total is None else [a, b, self.total]
        a, b, *rest = circuit.align(operands)
        circuit._require(a)
        product = circuit._out(circuit.evaluator.multiply, a, b)
        circuit.stats.products += 1
        if self.total is None:
            self.total = product
        else:
            total = rest[0]
            circuit.evaluator.add_inplace(total, product)
            self.total = total

    @_timed("ciphertext products")
    def result(self) -> Ciphertext:
        if self.total is None:
            raise ProtocolError("internal: an empty product sum")
        circuit = self.circuit
        circuit.evaluator.relinearize_inplace(self.total, circuit.relin_keys)
        return circuit._rescale(self.total)


# -- traced polynomials ---------------------------------------------------------------------------
class Traced:
    """A symbolic value: running an evaluator of :mod:`fedfm.approx.evaluate` on it records the
    operations (a DAG) that :func:`evaluate_traced` then executes on ciphertexts."""

    __slots__ = ("args", "const", "op")

    def __init__(self, op: str, args: tuple[Traced, ...] = (), const: float = 0.0) -> None:
        self.op = op
        self.args = args
        self.const = const

    def __add__(self, other: Any) -> Traced:
        if isinstance(other, Traced):
            return Traced("add", (self, other))
        return Traced("add_c", (self,), float(other))

    __radd__ = __add__

    def __sub__(self, other: Any) -> Traced:
        if isinstance(other, Traced):
            return Traced("sub", (self, other))
        return Traced("add_c", (self,), -float(other))

    def __rsub__(self, other: Any) -> Traced:
        return Traced("rsub_c", (self,), float(other))

    def __mul__(self, other: Any) -> Traced:
        if isinstance(other, Traced):
            return Traced("mul", (self, other))
        return Traced("mul_c", (self,), float(other))

    __rmul__ = __mul__


def evaluate_traced(
    circuit: Circuit,
    output: Traced,
    inputs: dict[Traced, list[Ciphertext]],
    place: str,
    *,
    output_headroom: int = 0,
    keep: dict[Traced, int] | None = None,
) -> Work[list[Ciphertext]]:
    """Execute the traced ``output`` on each ciphertext of the input tensors.

    A product whose operand has no headroom refreshes that operand's whole tensor first, and in
    the same round trip the other live values whose refresh saves a later round trip
    (:func:`fedfm.crypto.schedule.choose_refresh`). ``output_headroom`` is the headroom the
    caller's next operation needs of the result (at most what a refresh gives): the schedule
    plans for it, and the result is refreshed at the end if it still lacks it. ``keep`` maps
    inputs the caller uses afterwards (they need not take part in ``output``) to the headroom
    it needs of them: they are planned for the same way, and their tensors in ``inputs``
    replaced by the refreshed ones if they were refreshed (the only change made to ``inputs``).
    """
    memo: dict[int, list[Ciphertext]] = {id(node): cts for node, cts in inputs.items()}
    order: list[Traced] = []
    seen: set[int] = set(memo)

    def visit(node: Traced) -> None:
        stack = [(node, False)]
        while stack:
            current, expanded = stack.pop()
            if id(current) in seen and not expanded:
                continue
            if expanded:
                order.append(current)
                continue
            seen.add(id(current))
            stack.append((current, True))
            stack.extend((arg, False) for arg in current.args if id(arg) not in seen)

    def lowest(key: int) -> int:
        return min(circuit.headroom(ct) for ct in memo[key])

    def refresh(keys: list[int]) -> Work[None]:
        fresh = yield from circuit.refresh([ct for key in keys for ct in memo[key]], place)
        for key in keys:  # a tensor is refreshed whole, so that its parts stay aligned
            memo[key], fresh = fresh[: len(memo[key])], fresh[len(memo[key]) :]
            headroom[key] = lowest(key)

    kept = keep or {}
    if any(node not in inputs for node in kept):
        raise ProtocolError("internal: only inputs of a traced polynomial can be kept")
    visit(output)
    full = circuit.full_headroom
    # a refresh gives no more than full headroom: a greater need is met by the next refresh
    needs = {id(node): min(need, full) for node, need in kept.items()}
    needs[id(output)] = min(max(output_headroom, needs.get(id(output), 0)), full)
    last = last_uses(order, needs)
    headroom = {key: lowest(key) for key in memo}
    sizes = {key: len(cts) for key, cts in memo.items()}
    for index, node in enumerate(order):
        if node.op == "input":
            raise ProtocolError("traced polynomial has an input that was not provided")
        chosen = choose_refresh(order, index, headroom, last, full, needs, sizes)
        if chosen:
            yield from refresh(chosen)
        args = [memo[id(arg)] for arg in node.args]
        memo[id(node)] = [_apply(circuit, node, *items) for items in zip(*args, strict=True)]
        headroom[id(node)] = lowest(id(node))
        sizes[id(node)] = len(memo[id(node)])
    missing = short(headroom, needs)
    if missing:
        yield from refresh(missing)
    for node in kept:
        inputs[node] = memo[id(node)]
    return memo[id(output)]


def dry_run(
    output: Traced,
    inputs: dict[Any, int],
    full: int,
    *,
    output_headroom: int = 0,
    keep: dict[Any, int] | None = None,
    copies: int | dict[Any, int] = 1,
) -> LevelStats:
    """A level-only dry run (:class:`~fedfm.crypto.schedule.LevelCircuit`): round trips and
    refreshed ciphertexts of evaluating the traced ``output`` from inputs
    at the given headrooms (``copies`` ciphertexts per tensor, or per input); ``keep`` as for
    :func:`~fedfm.crypto.circuit.evaluate_traced`."""
    circuit = LevelCircuit(full)
    drive(
        evaluate_traced(
            circuit,  # type: ignore[arg-type]
            output,
            {
                node: [room] * (copies if isinstance(copies, int) else copies[node])
                for node, room in inputs.items()
            },
            "dry run",
            output_headroom=output_headroom,
            keep=keep,
        ),
        lambda items: items,
    )
    return circuit.stats


def _apply(circuit: Circuit, node: Traced, *cts: Ciphertext) -> Ciphertext:
    if node.op == "add":
        return circuit.add(*cts)
    if node.op == "sub":
        return circuit.sub(*cts)
    if node.op == "mul":
        return circuit.multiply(*cts)
    if node.op == "mul_c":
        return circuit.scale_by(cts[0], node.const)
    if node.op == "add_c":
        return circuit.add_scalar(cts[0], node.const)
    if node.op == "rsub_c":
        return circuit.add_scalar(circuit.negate(cts[0]), node.const)
    raise ProtocolError(f"unknown traced operation {node.op!r}")


def symbol() -> Traced:
    """A fresh traced input."""
    return Traced("input")


# Jobs the worker pool runs for Circuit.spread (module-level: a worker unpickles them by
# reference). In a worker: evaluation circuits by context file (path, size, modification time).
_CIRCUITS: OrderedDict[tuple[str, int, int, int], Circuit] = OrderedDict()


def encode_nested(value: Any) -> Any:
    """Nested lists and tuples of SEAL ciphertexts as the same nesting of compact bytes."""
    if isinstance(value, (list, tuple)):
        return [encode_nested(item) for item in value]
    return dumps(value)


def decode_nested(io: Any, value: Any) -> Any:
    """The inverse of :func:`encode_nested` for ``io``'s context (a ``SealIO``)."""
    if isinstance(value, list):
        return [decode_nested(io, item) for item in value]
    return io.load_ciphertext(value)


class _NoRefresh:
    """A segment's refresher: segments are cut so that no level runs out inside them."""

    def mask_many(self, cts: Sequence[Any]) -> Any:
        raise ProtocolError("internal: a block segment sent to a worker needed a refresh")


def run_segment(
    context_path: str,
    steps: Sequence[int],
    function: Callable[..., Any],
    inputs: Sequence[Any],
    options: dict[str, Any],
    refresh_index: int = 1,
) -> tuple[Any, dict[str, Any]]:
    """In a worker: ``function(circuit, *inputs, **options)`` on a circuit of the public context
    saved at ``context_path``; ciphertexts travel as :func:`encode_nested` forms. Returns the
    result and the operations it took (:meth:`CircuitStats.operations`)."""
    status = os.stat(context_path)
    key = (context_path, status.st_size, status.st_mtime_ns, refresh_index)
    if key in _CIRCUITS:
        _CIRCUITS.move_to_end(key)
        circuit = _CIRCUITS[key]
    else:
        with open(context_path, "rb") as handle:
            context = ts.context_from(handle.read())
        circuit = Circuit(context, _NoRefresh(), refresh_index)
        circuit.declare_steps(steps)
        _CIRCUITS[key] = circuit
        while len(_CIRCUITS) > CONTEXTS_PER_WORKER:
            _CIRCUITS.popitem(last=False)
    circuit.stats = CircuitStats()
    result = function(circuit, *(decode_nested(circuit.io, item) for item in inputs), **options)
    return encode_nested(result), circuit.stats.operations()
