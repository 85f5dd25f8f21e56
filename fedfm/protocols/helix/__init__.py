"""HELIX: secure linear alignment and encrypted linear inference between independent models.

A provider (Party A) holds an encoder ``g_A`` and a linear head ``f_A(z) = z V + c``; a client
(Party B) holds its own encoder ``g_B`` and private queries. Under CKKS (TenSEAL), the client
learns the affine map ``(W*, b*)`` from ``g_B`` into ``g_A``'s space on public data without either
side revealing its embeddings, then gets ``f_A`` on its aligned queries without revealing them;
the provider never holds a secret key and the client never sees ``V`` or ``c``. Spec 000
(Sec. 4.4-4.5, App. G.6-G.7); see ``docs/helix.md``.

Modules: :mod:`~fedfm.protocols.helix.ridge` (the map, plaintext),
:mod:`~fedfm.protocols.helix.packing` (slot layouts), :mod:`~fedfm.protocols.helix.ckks` (the
TenSEAL seam), :mod:`~fedfm.protocols.helix.protocol` (roles and steps on the fedfm runtime).
Shared with other protocols: :mod:`fedfm.data.stdlib_text` (text) and
:mod:`fedfm.models.text_encoders` (models). Harness: :mod:`fedfm.experiments.helix_evaluation`
(Tables 1/4 metrics, App. J) and :mod:`fedfm.experiments.helix_bench`.
"""

from fedfm.protocols.helix.protocol import PROVIDER, client_role, helix, open_report
from fedfm.protocols.helix.ridge import AffineMap, fit_alignment

__all__ = ["PROVIDER", "AffineMap", "client_role", "fit_alignment", "helix", "open_report"]
