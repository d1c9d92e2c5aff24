"""How a stand-in cloud's injected fault counts the requests it matches: the first few pass, then a number of them (or
all) fail. Shared by the GCE and ARM stand-ins (tests/gce_server.py, tests/azure_arm_server.py)."""

from __future__ import annotations


class FaultBudget:
    """Mixed into a fault dataclass that declares passed, fired (both counted here) and times (None: no end)."""

    passed: int
    fired: int
    times: int | None

    def _fires_after(self, passing: int) -> bool:
        """Counts one matching request; whether it fails (the first `passing` pass, then `times` fail)."""
        if self.passed < passing:
            self.passed += 1
            return False
        if self.times is not None and self.fired >= self.times:
            return False
        self.fired += 1
        return True
