"""The billing usage bodies (tinker/types/billing_usage_response.py, current_checkpoint_storage_usage_response.py),
as /openapi.json describes them. This server prices nothing: every cost and rate is null."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from pydantic import BaseModel, Field


class TrainingBillingEvent(BaseModel):
    type: Literal["training"] = "training"
    token_count: int = Field(description="input tokens of forward and forward_backward requests that ran")


class SamplingPrefillBillingEvent(BaseModel):
    type: Literal["sampling_prefill"] = "sampling_prefill"
    cached: bool = Field(description="true: prompt tokens served from the prefix cache")
    token_count: int = Field(description="prompt tokens of samples that ran, once per request")


class SamplingSampleBillingEvent(BaseModel):
    type: Literal["sampling_sample"] = "sampling_sample"
    token_count: int = Field(description="tokens generated")


class CheckpointBillingEvent(BaseModel):
    type: Literal["checkpoint"] = "checkpoint"
    count: int = Field(description="checkpoints saved (completely written)")


class StorageBillingEvent(BaseModel):
    type: Literal["storage"] = "storage"
    free: bool = False
    gigabyte_hours: float


BillingEventInfo = Annotated[TrainingBillingEvent | SamplingPrefillBillingEvent | SamplingSampleBillingEvent |
                             CheckpointBillingEvent | StorageBillingEvent, Field(discriminator="type")]


class BillingUsageEvent(BaseModel):
    bucket_start: datetime
    bucket_end: datetime
    base_model: str | None = None
    user_id: str | None = Field(default=None, description="the API key id ('local' under --auth none)")
    user_name: str | None = Field(default=None, description="the API key's name")
    session_id: str | None = None
    project_id: str | None = None
    estimated_cost_usd: float | None = None
    effective_rate_usd_per_million_tokens: float | None = None
    effective_rate_usd_per_gigabyte_month: float | None = None
    event_info: BillingEventInfo


class BillingUsageSession(BaseModel):
    user_metadata: dict[str, str] | None = None


class BillingUsageResponse(BaseModel):
    data: list[BillingUsageEvent]
    sessions: dict[str, BillingUsageSession] = Field(default_factory=dict)
    cost_data_through: datetime | None = None


class CurrentCheckpointStorageUsageItem(BaseModel):
    project_id: str | None = None
    org_user_urn: str | None = Field(default=None, description="skyrl_tx:key:<key id> of the checkpoints' owner")
    user_email: str | None = None
    user_name: str | None = None
    checkpoint_count: int
    size_bytes: int
    size_gigabytes: float = Field(description="size_bytes / 10^9")
    estimated_monthly_cost_usd: float | None = None


class CurrentCheckpointStorageUsageResponse(BaseModel):
    effective_rate_usd_per_gigabyte_month: float | None = None
    data: list[CurrentCheckpointStorageUsageItem]
