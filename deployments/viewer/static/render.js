// Drawing one run in its panel: the cells grouped by block, or by canvas on a renoising model (as they
// stood at the replayed step), the replay slider, the per-block table and the tokens-per-step chart.
import { edited } from "./run.js";

const SVG = "http://www.w3.org/2000/svg";
const PALETTE = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]]; // viridis

function element(tag, attrs = {}, text = null) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== null) node.textContent = text;
  return node;
}

/** Viridis at t in [0, 1], with a text colour that reads on it. */
function ramp(t) {
  const x = Math.min(1, Math.max(0, t)) * (PALETTE.length - 1);
  const i = Math.min(PALETTE.length - 2, Math.floor(x));
  const mix = PALETTE[i].map((c, k) => Math.round(c + (PALETTE[i + 1][k] - c) * (x - i)));
  return { background: `rgb(${mix.join(",")})`, color: t > 0.55 ? "#111" : "#fff" };
}

function shown(text) {
  return text.replace(/\n/g, "↵").replace(/\t/g, "⇥").replace(/ /g, "·");
}

function summary(settings) {
  return Object.entries(settings).filter(([, v]) => v !== null && v !== undefined)
    .map(([k, v]) => `${k}=${JSON.stringify(v)}`).join("  ");
}

export class Panel {
  constructor(container, run) {
    this.run = run;
    this.following = true; // the slider follows the newest step until the user moves it
    this.colourBy = "step";
    this.root = element("section", { class: "run", "data-run": run.label.toLowerCase() });
    const head = element("header");
    head.append(element("h2", {}, run.label), element("span", { class: "settings" }, summary(run.settings)));
    this.status = element("span", { class: "status" });
    head.append(this.status);
    this.cells = element("div", { class: "cells" });
    this.slider = element("input", { type: "range", class: "replay", min: "0", max: "0", value: "0",
                                     "aria-label": `replay run ${run.label}` });
    this.stepLabel = element("output", { class: "step-label" });
    this.slider.addEventListener("input", () => {
      this.following = Number(this.slider.value) === this.run.maxStep;
      this.draw();
    });
    const replay = element("div", { class: "replay-row" });
    replay.append(element("span", {}, "replay"), this.slider, this.stepLabel);
    this.chart = document.createElementNS(SVG, "svg");
    this.chart.setAttribute("class", "chart");
    this.table = element("table", { class: "per-block" });
    this.totals = element("p", { class: "totals" });
    const figures = element("div", { class: "figures" });
    figures.append(this.chart, this.table);
    this.root.append(head, this.cells, replay, this.totals, figures);
    container.append(this.root);
  }

  setStatus(text, kind) {
    this.status.textContent = text;
    this.root.dataset.status = kind;
  }

  /** Move the replay by `delta` steps (arrow keys). */
  stepBy(delta) {
    const step = Math.max(0, Math.min(this.run.maxStep, Number(this.slider.value) + delta));
    this.slider.value = String(step);
    this.following = step === this.run.maxStep;
    this.draw();
  }

  draw() {
    const run = this.run;
    const maxStep = run.maxStep;
    this.slider.max = String(maxStep);
    if (this.following) this.slider.value = String(maxStep);
    const at = Number(this.slider.value);
    this.stepLabel.textContent = `step ${at} / ${maxStep}`;
    const fragment = document.createDocumentFragment();
    for (const group of run.blocks()) {
      // a canvas (a LinearSpec verify) is drawn as a block is, named by its place among the canvases (verifies)
      const box = element("div", run.canvas ? { class: "block canvas", "data-canvas": String(group.name) }
        : run.speculative ? { class: "block verify", "data-verify": String(group.name) }
        : { class: "block", "data-block": String(group.block) });
      box.append(element("span", { class: "block-label", title: run.describe(group) }, run.groupLabel(group)));
      for (const p of group.positions) box.append(this.cell(p, at, maxStep, group));
      fragment.append(box);
    }
    this.cells.replaceChildren(fragment);
    this.drawFigures();
  }

  cell(position, at, maxStep, group) {
    const run = this.run;
    const { writes, final } = run.cells[position];
    const last = writes[writes.length - 1];
    const step = final ? final.step : last ? last.step : null;
    const tokenId = final ? final.tokenId : last ? last.tokenId : null;
    const attrs = { class: "cell", "data-position": String(position) };
    if (step !== null) attrs["data-step"] = String(step);
    if (tokenId !== null) attrs["data-token-id"] = String(tokenId);
    const edits = edited(writes);
    if (edits) attrs["data-edits"] = String(edits);
    if (writes.some((w) => w.moved)) attrs["data-moved"] = "true";
    const node = element("span", attrs);
    const seen = writes.filter((w) => w.step <= at);
    if (!seen.length) {
      node.classList.add("masked");
      node.textContent = "▒";
    } else {
      const now = seen[seen.length - 1];
      node.textContent = shown(run.text(now.tokenId));
      if (edited(seen)) node.classList.add("edited");
      if (now.moved) node.classList.add("moved");
      if (now.step === at) node.classList.add("new");
      if (!final) node.classList.add("pending");
      const value = final ? final.value : null;
      const colours = this.colourBy === "value" && value !== null
        ? ramp(Math.exp(Math.min(0, value)))
        : ramp(maxStep > 1 ? (now.step - 1) / (maxStep - 1) : 0);
      node.style.background = colours.background;
      node.style.color = colours.color;
    }
    node.title = this.tooltip(position, writes, final, group);
    return node;
  }

  tooltip(position, writes, final, group) {
    const run = this.run;
    const lines = [`position ${position} (${run.describe(group)})`];
    for (const [i, w] of writes.entries()) {
      const what = w.moved ? "moved here" : i ? "edited" : "written";
      lines.push(`${what} at step ${w.step}: ${JSON.stringify(run.text(w.tokenId))} (id ${w.tokenId})`);
    }
    if (final && final.value !== null) lines.push(`${run.valueName} ${final.value.toFixed(4)}`);
    if (!final) lines.push(run.finished ? "not output" : "decoded, not yet released");
    return lines.join("\n");
  }

  drawFigures() {
    const run = this.run;
    const perStep = run.tokensPerStep();
    const tokens = run.cells.length;
    const steps = perStep.size;
    const edits = run.cells.reduce((n, c) => n + edited(c.writes), 0);
    const parts = [`${tokens} tokens`, `${steps} steps`, `${(tokens / Math.max(1, steps)).toFixed(2)} tokens/step`];
    if (edits) parts.push(`${edits} edits`);
    if (run.serverSteps !== null) parts.push(`server: ${run.serverSteps} denoising steps`);
    if (run.finish) parts.push(`finish: ${run.finish.type}`);
    this.totals.textContent = parts.join(" · ");
    this.drawTable(run.blockFigures());
    this.drawChart(perStep);
  }

  drawTable(rows) {
    const head = element("tr");
    for (const h of [this.run.unit, "tokens", "steps", "tokens/step", "edits"]) head.append(element("th", {}, h));
    const body = rows.map((r) => {
      const tr = element("tr");
      for (const v of [r.name, r.tokens, r.steps, (r.tokens / Math.max(1, r.steps)).toFixed(2), r.edits]) {
        tr.append(element("td", {}, String(v)));
      }
      return tr;
    });
    this.table.replaceChildren(head, ...body);
  }

  drawChart(perStep) {
    const entries = [...perStep.entries()];
    const height = 60;
    const bar = Math.max(2, Math.min(14, Math.floor(360 / Math.max(1, entries.length))));
    const top = Math.max(1, ...entries.map(([, n]) => n));
    this.chart.setAttribute("width", String(Math.max(120, entries.length * bar + 30)));
    this.chart.setAttribute("height", String(height + 14));
    const nodes = [];
    const title = document.createElementNS(SVG, "text");
    title.setAttribute("x", "0");
    title.setAttribute("y", String(height + 12));
    title.textContent = `tokens per step (max ${top})`;
    nodes.push(title);
    entries.forEach(([step, n], i) => {
      const rect = document.createElementNS(SVG, "rect");
      const h = Math.max(1, Math.round((n / top) * (height - 4)));
      rect.setAttribute("x", String(i * bar));
      rect.setAttribute("y", String(height - h));
      rect.setAttribute("width", String(Math.max(1, bar - 1)));
      rect.setAttribute("height", String(h));
      rect.setAttribute("fill", ramp(entries.length > 1 ? i / (entries.length - 1) : 0).background);
      const tip = document.createElementNS(SVG, "title");
      tip.textContent = `step ${step}: ${n} tokens`;
      rect.append(tip);
      nodes.push(rect);
    });
    this.chart.replaceChildren(...nodes);
  }
}
