"""The soak's settings (the CLI fills them)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class SoakSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str | None = Field(None, description="a running application's base URL (None: start one)")
    api_key: str | None = None
    app: str = Field("blockserve", description="the application's name (its processes and handle)")
    ray_address: str | None = Field(None, description="join this Ray cluster for handle calls and faults")
    model: str | None = Field(None, description="checkpoint to serve when starting an app (None: tiny SDAR)")
    tp: int = Field(1, ge=1)
    replicas: int = Field(1, ge=1)
    iterations: int | None = Field(None, ge=1)
    minutes: float | None = Field(None, gt=0)
    prompts: int = Field(2, ge=1, description="prompts per rollout batch")
    samples: int = Field(2, ge=1, description="n: samples per prompt")
    max_tokens: int = Field(24, ge=1, description="token budget of a rollout sample")
    drill_tokens: int = Field(200, ge=1, description="token budget of a drill's requests (long enough that "
                                                     "a pause or a fault lands while they generate)")
    update_from: str | None = Field(None, description="checkpoint of the disk updates (None: the served one)")
    broadcast: bool = Field(True, description="also update by one flattened broadcast (the soak is rank 0)")
    kill_replica_every: int = Field(0, ge=0, description="kill an engine replica every k iterations (0: never)")
    kill_tp_worker_every: int = Field(0, ge=0, description="kill a TP worker every k iterations (0: never)")
    drop_client_every: int = Field(0, ge=0, description="a client drops mid-body every k iterations (0: never)")
    leak_limit_mb: float = Field(50.0, gt=0, description="allowed growth per 200 iterations after warm-up")
    inject_leak_mb: float = Field(0.0, ge=0, description="test of the verdict: each engine keeps this much more "
                                                         "memory every iteration (needs an app of deployments.drills)")
    out: str | None = Field(None, description="folder for soak.jsonl, summary.json and the PNGs (default: a new "
                                               "temporary folder, named on stderr)")
    request_timeout_s: float = Field(300.0, gt=0, description="a request still open after it has hung")

    @model_validator(mode="after")
    def _one_stop(self) -> SoakSettings:
        if self.iterations is None and self.minutes is None:
            raise ValueError("give --iterations or --minutes (or both: whichever comes first ends the run)")
        return self
