"""Secure aggregation (SecAgg+): the server learns only the weighted average of client updates.

Bonawitz et al. 2017 with the sparse neighbour graph of Bell et al. 2020, as transport-agnostic
protocol logic: typed messages that encode to ``(arrays, config)`` records, a pure client step
function whose state encodes the same way, and an in-memory server state machine. See
``docs/secure_aggregation.md``.

Stages (server-driven, one request and one reply per client each):

1. ``advertise_keys``: each client draws two X25519 key pairs (``c`` for share encryption,
   ``s`` for pairwise masks) and a self-mask seed ``b``, and sends the two public keys signed
   by its long-term Ed25519 identity.
2. ``share_keys``: the server draws a random ``k``-regular graph over the clients that answered
   and sends each its neighbours' public keys and signatures; the client checks that each
   neighbour's keys are signed by an identity its data owner pinned
   (:mod:`fedfm.secagg.authentication`), Shamir-shares ``b`` and ``s``'s private key
   (threshold ``t`` among its ``k`` neighbours) and returns one ChaCha20-Poly1305 ciphertext
   per neighbour.
3. ``collect_masked_input``: the server forwards each client the ciphertexts addressed to it;
   the client sends ``y = [N q, N] + PRG(b) + sum_v +-PRG(s_uv) mod 2**64``, where ``q`` is its
   quantized update and ``N`` its number of examples.
4. ``unmask``: the server says which neighbours sent ``y`` and which did not; the client returns
   shares of ``b`` for the former and of ``s``'s private key for the latter. The server rebuilds
   the secrets, strips the masks and decodes ``sum N q / sum N``.

What each party sees (public keys authenticated by pinned identities, or a server that follows
the protocol in the semi-honest mode; ``docs/secure_aggregation.md`` has the threat model):

* The server: public keys, ciphertexts it cannot open, each client's masked input (uniformly
  distributed on its own), and for every node either ``t`` shares of ``b`` (if it sent ``y``)
  or of ``s``'s private key (if it did not), never both; hence only ``sum N q`` and ``sum N``
  over the included clients, and who dropped when.
* A client: its neighbours' ids and public keys, one share of each neighbour's secrets, and
  which neighbours the server says survived. Nothing about any other client's update.
"""

from fedfm.secagg.authentication import (
    KeyAuthentication,
    KeyAuthenticationError,
    Signer,
    fingerprint,
)
from fedfm.secagg.client import (
    ClientSecAggState,
    ClientUpdate,
    advertise_keys,
    collect_masked_input,
    handle,
    share_keys,
    unmask,
)
from fedfm.secagg.config import ClientSettings, RoundParameters, SecAggConfig
from fedfm.secagg.graph import harary_graph, neighbour_degree, random_neighbour_graph
from fedfm.secagg.layout import ArrayLayout
from fedfm.secagg.masking import expand_mask
from fedfm.secagg.messages import (
    ADVERTISE_KEYS,
    COLLECT_MASKED_INPUT,
    SHARE_KEYS,
    STAGES,
    UNMASK,
    AdvertiseKeysReply,
    AdvertiseKeysRequest,
    MaskedInputReply,
    MaskedInputRequest,
    NeighbourKeys,
    Reply,
    Request,
    ShareKeysReply,
    ShareKeysRequest,
    UnmaskReply,
    UnmaskRequest,
    decode_reply,
    decode_request,
    stage_of,
)
from fedfm.secagg.quantization import Quantizer
from fedfm.secagg.server import SecAggResult, SecAggServer

__all__ = [
    "ADVERTISE_KEYS",
    "COLLECT_MASKED_INPUT",
    "SHARE_KEYS",
    "STAGES",
    "UNMASK",
    "AdvertiseKeysReply",
    "AdvertiseKeysRequest",
    "ArrayLayout",
    "ClientSecAggState",
    "ClientSettings",
    "ClientUpdate",
    "KeyAuthentication",
    "KeyAuthenticationError",
    "MaskedInputReply",
    "MaskedInputRequest",
    "NeighbourKeys",
    "Quantizer",
    "Reply",
    "Request",
    "RoundParameters",
    "SecAggConfig",
    "SecAggResult",
    "SecAggServer",
    "ShareKeysReply",
    "ShareKeysRequest",
    "Signer",
    "UnmaskReply",
    "UnmaskRequest",
    "advertise_keys",
    "collect_masked_input",
    "decode_reply",
    "decode_request",
    "expand_mask",
    "fingerprint",
    "handle",
    "harary_graph",
    "neighbour_degree",
    "random_neighbour_graph",
    "share_keys",
    "stage_of",
    "unmask",
]
