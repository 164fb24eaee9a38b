"""Skip markers for tests of features a torch release may lack (the fast tier also runs on torch 2.11)."""

import pytest

from lightning_ckpt.core.policy import compiler_budget_unavailable

needs_compiler_budget = pytest.mark.skipif(compiler_budget_unavailable() is not None,
                                           reason=str(compiler_budget_unavailable()))
