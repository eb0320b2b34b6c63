"""Tests that start a cluster, a server process or a browser of their own: multi-node drills, the
viewer in headless Chromium, the soak, `blockserve serve` on a shared machine or a taken port."""
