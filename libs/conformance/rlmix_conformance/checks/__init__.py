"""The checks, one module per hook (``every_plugin``: the checks every plugin gets). Importing
this package registers them in ``rlmix_conformance.kit.CHECKS``, in the order ``plan`` runs
them: every plugin's first, then the hooks in the order below (so the imports are not sorted)."""
# isort: skip_file

from rlmix_conformance.checks import every_plugin  # noqa: F401
from rlmix_conformance.checks import advantage  # noqa: F401
from rlmix_conformance.checks import clip  # noqa: F401
from rlmix_conformance.checks import sample  # noqa: F401
from rlmix_conformance.checks import generate  # noqa: F401
from rlmix_conformance.checks import prompts  # noqa: F401
from rlmix_conformance.checks import score  # noqa: F401
from rlmix_conformance.checks import evaluate  # noqa: F401
from rlmix_conformance.checks import evolve  # noqa: F401
from rlmix_conformance.checks import update  # noqa: F401
from rlmix_conformance.checks import token_logprobs  # noqa: F401
