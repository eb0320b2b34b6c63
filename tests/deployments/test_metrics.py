"""/metrics: Prometheus text that prometheus_client's parser reads, with the series vLLM / SGLang users
chart -- request latency histograms, running / waiting requests, KV usage, prefix-cache hits, and for
block diffusion tokens per step -- one series per engine replica."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

TIMEOUT = 120
HISTOGRAMS = ("blockserve_time_to_first_token_seconds", "blockserve_time_per_output_token_seconds",
              "blockserve_e2e_request_latency_seconds")
GAUGES = ("blockserve_num_requests_running", "blockserve_num_requests_waiting", "blockserve_kv_cache_usage_ratio",
          "blockserve_prefix_cache_hit_rate")


def scrape(url: str) -> dict[str, list]:
    r = httpx.get(url + "/metrics", timeout=TIMEOUT)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def count(family, replica: str | None = None) -> float:
    """A histogram's observation count, over all replicas or one."""
    return sum(s.value for s in family.samples
               if s.name.endswith("_count") and (replica is None or s.labels["replica"] == replica))


def test_metrics_parse_and_hold_the_latency_histograms(served_apps):
    sdar, qwen3 = served_apps["sdar"], served_apps["qwen3"]
    before = scrape(sdar.url)
    body = {"prompt": "The same long prompt, twice over", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    for _ in range(2):  # the second one finds the first one's full pages in the prefix cache
        assert httpx.post(sdar.url + "/generate", json=body, timeout=TIMEOUT).status_code == 200
    with httpx.stream("POST", sdar.url + "/generate", json={**body, "stream": True}, timeout=TIMEOUT) as r:
        r.read()
    after = scrape(sdar.url)
    for name in (*HISTOGRAMS, "blockserve_request_tokens_per_step"):
        assert after[name].type == "histogram", name
        assert count(after[name]) - (count(before[name]) if name in before else 0) == 3, name
        buckets = [s for s in after[name].samples if s.name.endswith("_bucket")]
        assert buckets[-1].labels["le"] == "+Inf" and buckets[-1].value == count(after[name])
        assert {s.labels["model"] for s in after[name].samples} == {"sdar"}
    # these 12-token outputs were revealed in fewer than 12 steps (dynamic unmasking): above 1 token a step
    def at_most_one_per_step(families) -> float:
        fam = families.get("blockserve_request_tokens_per_step")
        return 0 if fam is None else next(s.value for s in fam.samples if s.name.endswith("_bucket")
                                          and s.labels["le"] == "1.0")

    assert at_most_one_per_step(after) == at_most_one_per_step(before)
    for name in GAUGES:
        assert after[name].type == "gauge" and len(after[name].samples) == 1, name
    hits = after["blockserve_prefix_cache_hits"].samples[0].value
    assert hits - before["blockserve_prefix_cache_hits"].samples[0].value > 0
    assert 0 < after["blockserve_prefix_cache_hit_rate"].samples[0].value <= 1
    requests = after["blockserve_requests"].samples
    assert any(s.labels["route"] == "/generate" and s.labels["status"] == "200" for s in requests)

    httpx.post(qwen3.url + "/generate", json={"prompt": "Hi", "max_tokens": 4}, timeout=TIMEOUT)
    ar = scrape(qwen3.url)
    replicas = {s.labels["replica"] for s in ar["blockserve_kv_pages_free"].samples}
    assert len(replicas) == 2 and all(len(ar[name].samples) == 2 for name in GAUGES)
    assert count(ar["blockserve_e2e_request_latency_seconds"]) >= 1
    assert "blockserve_request_tokens_per_step" not in ar or count(ar["blockserve_request_tokens_per_step"]) == 0
