// infertap's page: reads ui/data every few seconds and draws it. No library, no network but
// this server. Charts are inline SVG, so the numbers they show are in the DOM.
(() => {
  "use strict";

  const token = new URLSearchParams(location.search).get("token");
  const SVG = "http://www.w3.org/2000/svg";
  const $ = (id) => document.getElementById(id);
  let data = null;
  let configText = "";

  // -- formatting -------------------------------------------------------------------------
  function secs(v) {
    if (v === null || v === undefined) return "–";
    if (v === 0) return "0";
    if (v < 0.001) return (v * 1e6).toFixed(0) + " µs";
    if (v < 1) {
      const ms = v * 1000;
      return (ms < 10 ? ms.toFixed(2) : ms < 100 ? ms.toFixed(1) : ms.toFixed(0)) + " ms";
    }
    return v < 100 ? v.toFixed(2) + " s" : v.toFixed(0) + " s";
  }
  function num(v) {
    if (v === null || v === undefined) return "–";
    if (v === 0) return "0";
    if (Math.abs(v) < 10) return v.toFixed(2).replace(/\.?0+$/, "");
    if (Math.abs(v) < 100) return v.toFixed(1).replace(/\.0$/, "");
    return Math.round(v).toLocaleString("en-US");
  }
  function clock(t) {
    const d = new Date(t * 1000);
    return [d.getHours(), d.getMinutes(), d.getSeconds()].map((x) => String(x).padStart(2, "0")).join(":");
  }
  const TIME_STEPS = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600];
  // "6.00 ms" -> "6 ms", "2.50 ms" -> "2.5 ms": axis labels need no fixed precision.
  function trimZeros(text) {
    return text.replace(/(\.\d*?)0+(?!\d)/, "$1").replace(/\.(?!\d)/, "");
  }
  // A round tick step that puts about `n` gridlines under `max`.
  function niceStep(max, n) {
    const raw = max > 0 ? max / n : 1 / n;
    const e = Math.pow(10, Math.floor(Math.log10(raw)));
    const f = raw / e;
    return (f <= 1 ? 1 : f <= 2 ? 2 : f <= 2.5 ? 2.5 : f <= 5 ? 5 : 10) * e;
  }
  function outcomeClass(o) {
    if (o === "ok") return "ok";
    if (o === "client_disconnect") return "gone";
    if (o.endsWith("_timeout")) return "timeout";
    if (o === "rate_limited") return "limited";
    if (o === "client_error" || o === "rejected") return "client";
    return "error";
  }

  // -- DOM helpers ------------------------------------------------------------------------
  function el(tag, attrs, text) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
    if (text !== undefined && text !== null) e.textContent = text;
    return e;
  }
  function svg(tag, attrs) {
    const e = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
    return e;
  }

  // -- a line chart in SVG ----------------------------------------------------------------
  // series: [{name, cls, values}] aligned with `t`; format: the y-axis formatter.
  function lineChart(box, legend, t, series, format) {
    const width = Math.max(240, box.clientWidth || 320);
    const height = 170;
    const m = { l: 56, r: 10, t: 8, b: 22 };
    const w = width - m.l - m.r;
    const h = height - m.t - m.b;
    // The whole window, or since this worker started when that is shorter (at least a minute).
    const t1 = data.now;
    const t0 = t1 - Math.min(data.window_s, Math.max(60, data.uptime_s + data.step_s));
    const half = data.step_s / 2;
    let max = 0;
    for (const s of series) for (const v of s.values) if (v !== null && v > max) max = v;
    const step = niceStep(max, 4);
    const lines = Math.max(1, Math.ceil(max / step - 1e-9));
    const top = step * lines;
    const x = (tt) => m.l + (Math.min(Math.max(tt + half, t0), t1) - t0) / (t1 - t0) * w;
    const y = (v) => m.t + h - (v / top) * h;

    const root = svg("svg", { class: "chart", width, height, viewBox: `0 0 ${width} ${height}`, role: "img" });
    for (let i = 0; i <= lines; i++) {
      const v = step * i;
      root.append(svg("line", { class: "gridline", x1: m.l, x2: m.l + w, y1: y(v), y2: y(v) }));
      const label = svg("text", { class: "tick", x: m.l - 6, y: y(v) + 4, "text-anchor": "end" });
      label.textContent = trimZeros(format(v));
      root.append(label);
    }
    // Time ticks on round seconds or minutes, as many as fit.
    const most = Math.max(2, Math.floor(w / 80));
    const every = TIME_STEPS.find((s) => (t1 - t0) / s <= most) || 3600;
    for (let tt = Math.ceil(t0 / every) * every; tt <= t1; tt += every) {
      const px = m.l + ((tt - t0) / (t1 - t0)) * w;
      root.append(svg("line", { class: "gridline", x1: px, x2: px, y1: m.t + h, y2: m.t + h + 4 }));
      const label = svg("text", {
        class: "tick", x: px, y: height - 6,
        "text-anchor": px > m.l + w - 28 ? "end" : px < m.l + 28 ? "start" : "middle",
      });
      label.textContent = every >= 60 ? clock(tt).slice(0, 5) : clock(tt);
      root.append(label);
    }
    let total = 0;
    for (const s of series) {
      let d = "";
      let run = 0;
      let points = 0;
      const dots = [];
      s.values.forEach((v, i) => {
        if (v === null || v === undefined) {
          if (run === 1) dots.push(i - 1);
          run = 0;
          return;
        }
        d += `${run ? "L" : "M"}${x(t[i]).toFixed(1)},${y(v).toFixed(1)}`;
        run += 1;
        points += 1;
      });
      if (run === 1) dots.push(s.values.length - 1);
      const g = svg("g", { class: `series ${s.cls}`, "data-series": s.name, "data-points": points });
      if (d) g.append(svg("path", { d }));
      for (const i of dots) g.append(svg("circle", { cx: x(t[i]), cy: y(s.values[i]), r: 2.5 }));
      root.append(g);
      total += points;
    }
    root.setAttribute("data-points", total);
    box.replaceChildren(root);

    if (legend) {
      legend.replaceChildren(
        ...series.map((s) => {
          const latest = [...s.values].reverse().find((v) => v !== null && v !== undefined);
          const item = el("span", { class: `item ${s.cls}` });
          item.append(el("i"), document.createTextNode(`${s.name} ${latest === undefined ? "–" : format(latest)}`));
          return item;
        })
      );
    }
  }

  // -- sections ---------------------------------------------------------------------------
  function renderMeta() {
    const up = data.uptime_s;
    const uptime = up < 120 ? `${Math.round(up)} s` : up < 7200 ? `${Math.round(up / 60)} min` : `${(up / 3600).toFixed(1)} h`;
    let text = `v${data.version} · pid ${data.pid} · up ${uptime}`;
    if (data.workers > 1) text += ` · one of ${data.workers} workers: this page shows the worker that answered`;
    $("meta").textContent = text;
  }

  function renderTiles() {
    const lm = data.last_minute;
    const tot = data.totals;
    const sum = (o) => Object.values(o).reduce((a, b) => a + b, 0);
    const lmAll = sum(lm.requests);
    const lmBad = lmAll - (lm.requests.ok || 0) - (lm.requests.client_disconnect || 0);
    const count = (o, k) => o[k] || 0;
    const tiles = [
      ["requests/s", num(lm.requests_per_s), `${sum(tot.requests)} since start`, "rps"],
      ["in flight", String(data.in_flight), "now", "inflight"],
      ["tokens in/s", num(lm.prompt_tokens_per_s), `${num(tot.prompt_tokens)} since start`, "tin"],
      ["tokens out/s", num(lm.completion_tokens_per_s), `${num(tot.completion_tokens)} since start`, "tout"],
      ["errors", String(lmBad), lmAll ? `${((100 * lmBad) / lmAll).toFixed(1)} % of the last minute` : "last minute", "errors"],
      ["retries", String(lm.retries), `${tot.retries} since start`, "retries"],
      ["timeouts", String(lm.timeouts), `${sum(tot.timeouts)} since start`, "timeouts"],
      ["interrupted", String(count(lm.requests, "stream_interrupted")), `${count(tot.requests, "stream_interrupted")} since start`, "interrupted"],
      ["client gone", String(count(lm.requests, "client_disconnect")), `${count(tot.requests, "client_disconnect")} since start`, "disconnects"],
    ];
    $("tiles").replaceChildren(
      ...tiles.map(([label, value, note, key]) => {
        const tile = el("div", { class: "tile", "data-tile": key });
        tile.append(el("div", { class: "label" }, label), el("div", { class: "value" }, value), el("div", { class: "note" }, note));
        return tile;
      })
    );
  }

  function renderLatency() {
    const box = $("latency");
    const models = Object.keys(data.latency);
    const minutes = Math.round(data.window_s / 60);
    $("latency-note").textContent = `p50 · p90 · p99 per ${data.step_s} s, last ${minutes} min`;
    $("traffic-note").textContent = `per second, averaged over ${data.step_s} s`;
    if (!models.length) {
      box.replaceChildren(el("p", { class: "empty" }, `No streamed request in the last ${minutes} min.`));
      return;
    }
    const cards = models.map((model) => {
      const lat = data.latency[model];
      const card = el("div", { class: "card model", "data-model": model });
      card.append(el("h3", {}, model));
      const row = el("div", { class: "pair" });
      for (const [kind, title] of [["ttft", "TTFT (time to first token)"], ["tpot", "TPOT (time per output token)"]]) {
        const k = lat[kind];
        const fig = el("figure", { class: `latency ${kind}` });
        const w = k.window;
        const summary = w.count ? `${w.count} in window · p50 ${secs(w.p50)} · p90 ${secs(w.p90)} · p99 ${secs(w.p99)}` : "no sample in window";
        fig.append(el("figcaption", {}, title), el("div", { class: "summary" }, summary));
        const legend = el("div", { class: "legend" });
        const plot = el("div", { class: "plot" });
        fig.append(legend, plot);
        row.append(fig);
        card.dataset[kind] = "1";
        fig._series = [
          { name: "p50", cls: "p50", values: k.p50 },
          { name: "p90", cls: "p90", values: k.p90 },
          { name: "p99", cls: "p99", values: k.p99 },
        ];
        fig._legend = legend;
        fig._plot = plot;
      }
      card.append(row);
      return card;
    });
    if (data.other_models.length) {
      const n = data.other_models.length;
      cards.push(el("p", { class: "empty" }, `${n} more model${n > 1 ? "s" : ""} in the window, not charted: ${data.other_models.join(", ")}`));
    }
    box.replaceChildren(...cards);
    for (const fig of box.querySelectorAll("figure.latency")) {
      lineChart(fig._plot, fig._legend, data.series.t, fig._series, secs);
    }
  }

  const OUTCOME_ORDER = ["ok", "client_disconnect", "client_error", "rejected", "rate_limited", "upstream_error",
    "stream_interrupted", "connect_error", "connect_timeout", "ttft_timeout", "idle_timeout", "total_timeout"];

  function renderTraffic() {
    const s = data.series;
    const rps = s.requests_per_s;
    const outcomes = Object.keys(rps).sort((a, b) => OUTCOME_ORDER.indexOf(a) - OUTCOME_ORDER.indexOf(b));
    const zeros = s.t.map(() => 0);
    const reqSeries = outcomes.length
      ? outcomes.map((o) => ({ name: o, cls: `o-${outcomeClass(o)} o-${o}`, values: rps[o] }))
      : [{ name: "requests", cls: "o-ok", values: zeros }];
    const rate = (v) => num(v) + "/s";
    lineChart($("chart-requests"), $("legend-requests"), s.t, reqSeries, rate);
    lineChart($("chart-tokens"), $("legend-tokens"), s.t, [
      { name: "in (prompt)", cls: "tin", values: s.prompt_tokens_per_s },
      { name: "out (completion)", cls: "tout", values: s.completion_tokens_per_s },
    ], rate);
    lineChart($("chart-faults"), $("legend-faults"), s.t, [
      { name: "retries", cls: "retries", values: s.retries_per_s },
      { name: "timeouts", cls: "timeouts", values: s.timeouts_per_s },
    ], rate);
  }

  function renderRequests() {
    const rows = data.requests;
    $("requests-empty").hidden = rows.length > 0;
    let longest = 0;
    for (const r of rows) if (r.duration > longest) longest = r.duration;
    const body = $("requests").tBodies[0];
    body.replaceChildren(
      ...rows.map((r) => {
        const tr = el("tr", { "data-outcome": r.outcome, "data-request-id": r.request_id });
        tr.title = `request id ${r.request_id} · ${r.route}${r.stream ? " (stream)" : ""} · started ${clock(r.started)}` +
          (r.retries ? ` · ${r.retries} retries` : "");
        const badge = el("span", { class: `badge o-${outcomeClass(r.outcome)}` }, r.outcome.replace(/_/g, " "));
        const outcome = el("td");
        outcome.append(badge);
        const tokens = r.prompt_tokens === null ? "–" : `${num(r.prompt_tokens)} → ${num(r.completion_tokens)}${r.tokens_estimated && r.completion_tokens ? "*" : ""}`;
        tr.append(
          el("td", { class: "time" }, clock(r.time)),
          el("td", { class: "model" }, r.model || "–"),
          el("td", {}, r.upstream),
          outcome,
          el("td", { class: "num" }, r.status === null ? "–" : String(r.status)),
          el("td", { class: "num" }, secs(r.ttft)),
          el("td", { class: "num" }, secs(r.tpot)),
          el("td", { class: "num" }, tokens),
          el("td", { class: "num" }, secs(r.duration)),
          barCell(r, longest)
        );
        return tr;
      })
    );
  }

  function barCell(r, longest) {
    const td = el("td", { class: "bar" });
    const bar = el("div", { class: "timeline" });
    const total = r.duration || 0;
    if (total > 0 && longest > 0) {
      bar.style.width = `${Math.max(2, (100 * total) / longest)}%`;
      const prefill = r.ttft || 0;
      const decode = r.decode || 0;
      const rest = Math.max(0, total - prefill - decode);
      for (const [cls, v, what] of [["prefill", prefill, "prefill (TTFT)"], ["decode", decode, "decode"], ["rest", rest, "rest"]]) {
        if (v <= 0) continue;
        const seg = el("span", { class: `seg ${cls}`, title: `${what} ${secs(v)}` });
        seg.style.width = `${(100 * v) / total}%`;
        bar.append(seg);
      }
    }
    td.append(bar);
    return td;
  }

  function renderUpstreams() {
    const body = $("upstreams").tBodies[0];
    body.replaceChildren(
      ...data.upstreams.flatMap((u) => {
        const tr = el("tr", { "data-upstream": u.name, "data-state": u.state });
        const ok = u.requests.ok || 0;
        const all = Object.values(u.requests).reduce((a, b) => a + b, 0);
        const state = el("td");
        const label = u.state === "up" ? "up" : "circuit open";
        state.append(el("span", { class: `badge ${u.state === "up" ? "o-ok" : "o-error"}` }, label));
        if (u.since) state.append(document.createTextNode(` since ${clock(u.since)}`));
        let key = "none";
        if (u.api_key_env) key = `$${u.api_key_env} (${u.api_key_set ? "set" : "NOT set"})`;
        const name = el("td", {}, u.name + (u.default ? " (default)" : ""));
        tr.append(
          name,
          el("td", { class: "url" }, u.base_url),
          state,
          el("td", { class: "num" }, String(u.in_flight)),
          el("td", { class: "num" }, `${ok} / ${all - ok}`),
          el("td", {}, key),
          el("td", {}, u.models.length ? u.models.join(", ") : "any")
        );
        return [tr, ...(u.replicas || []).map((r) => replicaRow(u, r))];
      })
    );
  }

  // A pool's replica, under its upstream: admitted, ejected (its circuit open) or draining.
  function replicaRow(u, r) {
    const tr = el("tr", { class: "replica", "data-replica": r.address, "data-state": r.state });
    const badge = r.state === "up" ? "o-ok" : r.state === "draining" ? "o-gone" : "o-error";
    const state = el("td");
    state.append(el("span", { class: `badge ${badge}` }, r.state));
    if (r.why) state.title = r.why;
    tr.append(
      el("td", {}, `  ${u.balance || ""} replica`),
      el("td", { class: "url" }, r.address),
      state,
      el("td", { class: "num" }, String(r.in_flight)),
      el("td", { class: "num" }, `TTFT ${secs(r.ttft_seconds)}`),
      el("td", {}, ""),
      el("td", {}, "")
    );
    return tr;
  }

  function renderConfig() {
    const text = JSON.stringify(data.config, null, 2);
    if (text !== configText) {
      configText = text;
      $("config").textContent = text;
    }
    // Which configuration this is: a reload applies some sections, the rest wait for a restart.
    const reloadable = (data.config_reloadable || []).join(", ");
    const when = data.config_reloaded_at
      ? `${reloadable} as reloaded at ${clock(data.config_reloaded_at)}, the rest as at start`
      : `as loaded at start; a reload applies ${reloadable}, a restart the rest`;
    $("config-note").textContent = `what new requests follow: ${when}`;
  }

  function render() {
    renderMeta();
    renderTiles();
    renderLatency();
    renderTraffic();
    renderRequests();
    renderUpstreams();
    renderConfig();
    document.body.dataset.rendered = String((Number(document.body.dataset.rendered) || 0) + 1);
  }

  function status(text, bad) {
    const s = $("status");
    s.textContent = text;
    s.classList.toggle("bad", !!bad);
  }

  async function load() {
    const headers = token ? { Authorization: `Bearer ${token}` } : {};
    try {
      const resp = await fetch("ui/data", { headers, cache: "no-store" });
      if (!resp.ok) {
        let why = `HTTP ${resp.status}`;
        try {
          why += `: ${(await resp.json()).error.message}`;
        } catch (_) {
          // not an OpenAI-style error body: the status says enough
        }
        throw new Error(why);
      }
      data = await resp.json();
      render();
      status(`updated ${clock(data.now)} · every ${num(data.refresh_s)} s`, false);
    } catch (e) {
      status(`cannot load ui/data: ${e.message}`, true);
    }
    setTimeout(load, (data ? data.refresh_s : 5) * 1000);
  }

  let pending = false;
  window.addEventListener("resize", () => {
    if (pending || !data) return;
    pending = true;
    requestAnimationFrame(() => {
      pending = false;
      renderLatency();
      renderTraffic();
    });
  });

  load();
})();
