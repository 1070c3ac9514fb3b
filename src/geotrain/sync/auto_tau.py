"""``--tau auto``: a tau chosen once, at start-up, from a probe of the run's own step and exchange.

Streaming DiLoCo (how many steps a fragment's sync overlaps) and CO2 (how many steps into the
next period a period's mean lands) both take the fewest steps that hide their exchange. They
time it alike (``plan.profile.probe_step_and_gather``: whole steps, then one exchange, the
slowest worker's figures deciding for all), keep the choice in their state so that a resume and
an adopter run where the run chose, and say in the summary how tau was taken. ``AutoTau`` is
that part; each algorithm names its exchange (``_time_exchange``), turns the two figures into a
tau (``_tau_from``) and says what it chose (``_tau_said``, ``exchange_named``).
"""

from __future__ import annotations

from typing import Any

from geotrain.plan.profile import probe_step_and_gather


class AutoTau:
    """Mixed into a SyncAlgorithm whose config has ``tau`` and ``tau_auto`` (tau was "auto")."""

    def _init_auto_tau(self) -> None:
        # what the start-up probe measured (None: not yet; {} where nothing was measured), and
        # how tau was taken: "not measured", "measured", "alone", "restored" (or the algorithm's)
        self.tau_choice: dict[str, float] | None = None
        self.tau_taken = "not measured"

    def _time_exchange(self) -> float:
        """Seconds of one of the run's exchanges (on zeros)."""
        raise NotImplementedError

    def _tau_from(self, compute_s: float, exchange_s: float) -> int:
        raise NotImplementedError

    def _tau_said(self) -> str:
        """What the chosen tau does, for the line rank 0 prints."""
        raise NotImplementedError

    def prepare(self, loss_fn) -> None:
        """Time whole steps and one exchange, and take the tau that hides it. Not again where a
        restored state holds the choice."""
        if not self.config.tau_auto or self.tau_choice is not None:
            return
        if self.comm.world_size < 2:  # nothing to exchange (a joiner, alone until admitted, takes
            self.tau_choice, self.tau_taken = {}, "alone"  # the members' tau with their state)
            return
        compute_s, _, exchange = probe_step_and_gather(
            self.module, self.optimizer, loss_fn, self.comm, self._time_exchange
        )
        self.config.tau = self._tau_from(compute_s, exchange)
        self.tau_choice, self.tau_taken = {"compute_s": compute_s, "exchange_s": exchange}, "measured"
        self.notice(
            f"{self.name} --tau auto: {self._tau_said()} (a step's compute "
            f"{compute_s:.3f} s, {self.exchange_named} {exchange:.3f} s)",
        )

    exchange_named = "its exchange"  # in the printed line

    def prepare_unprofiled(self) -> None:
        if self.config.tau_auto:
            self.notice(
                f"{self.name} tau='auto' needs profile= (a function that computes a training "
                f"loss) to time a step and an exchange; running at tau={self.config.tau}",
            )

    def resolved_options(self) -> dict[str, Any]:
        if not self.config.tau_auto:
            return {}
        return {"tau": f"auto ({self.tau_taken}: {self.config.tau})"}

    def _restore_tau(self, state: dict[str, Any], before_tau: int) -> None:
        """Under auto, the tau the saver ran at: its own (``state["tau"]``), its config's where
        it saved none, ``before_tau`` from before the algorithm had one."""
        if self.config.tau_auto:
            self.config.tau = int(state.get("tau", state.get("config", {}).get("tau", before_tau)))
            self.tau_choice, self.tau_taken = {}, "restored"
