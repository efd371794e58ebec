// loraplex usage page: logs in with an API key, reads the tenant's own usage, limits and models from the
// JSON API and draws the charts as inline SVG. No libraries and nothing from other origins (see the CSP).
// The key lives in sessionStorage only (this tab) and travels only in the Authorization header.
"use strict";

(() => {
  const KEY_STORAGE = "loraplex.apiKey";
  const DAYS = 30;
  const HEADROOM_REFRESH_MS = 15000;
  const BATCHES_SHOWN = 20;
  const SVG_NS = "http://www.w3.org/2000/svg";
  // Shared with usage.css (--prompt, --cached, --completion, --gpu) and with the screenshot test.
  const COLORS = { prompt: "#4f6df5", cached: "#a9b8fb", completion: "#f59f3a", gpu: "#22a06b" };

  const $ = (id) => document.getElementById(id);
  const integer = new Intl.NumberFormat("en-US", { maximumFractionDigits: 0 });
  const decimal = new Intl.NumberFormat("en-US", { maximumFractionDigits: 2 });
  const compact = new Intl.NumberFormat("en-US", { notation: "compact", maximumFractionDigits: 1 });
  const small = new Intl.NumberFormat("en-US", { maximumSignificantDigits: 3 });
  const tick = (v) => (v >= 1000 ? compact.format(v) : small.format(v)); // 0.0025 s stays readable
  const seconds = (s) => `${decimal.format(s)} s`;
  let refreshTimer = null;

  class ApiError extends Error {
    constructor(status, message) {
      super(message);
      this.status = status;
    }
  }

  // One call to the JSON API; errors carry the API's own message ({"error": {"message": ...}}).
  async function api(path, key) {
    let response;
    try {
      response = await fetch(path, {
        headers: { Authorization: `Bearer ${key}`, Accept: "application/json" },
        cache: "no-store",
        credentials: "omit",
      });
    } catch (error) {
      throw new ApiError(0, `The server could not be reached (${error.message}).`);
    }
    let body = null;
    try {
      body = await response.json();
    } catch (_) {
      // not JSON: reported below by status
    }
    if (!response.ok) {
      const message = body && body.error && body.error.message;
      throw new ApiError(response.status, message || `Request failed with HTTP ${response.status}.`);
    }
    return body;
  }

  // --- period: the last 30 whole UTC days, today included -----------------------------------------

  function period() {
    const now = new Date();
    const end = new Date(Date.UTC(now.getUTCFullYear(), now.getUTCMonth(), now.getUTCDate() + 1));
    const start = new Date(end.getTime() - DAYS * 86400000);
    const days = [];
    for (let t = start.getTime(); t < end.getTime(); t += 86400000) {
      days.push(new Date(t).toISOString().slice(0, 10));
    }
    return { start: start.toISOString(), end: end.toISOString(), days };
  }

  function usagePath(p, groupBy) {
    const query = new URLSearchParams({ start: p.start, end: p.end, group_by: groupBy });
    return `/v1/usage?${query}`;
  }

  // Hourly rows -> one bucket per UTC day (the hour's ISO string starts with its date).
  function byDay(rows, days) {
    const buckets = new Map(days.map((d) => [d, { prompt: 0, cached: 0, completion: 0, gpu: 0 }]));
    for (const row of rows) {
      const bucket = buckets.get(String(row.hour).slice(0, 10));
      if (!bucket) continue;
      bucket.prompt += row.prompt_tokens;
      bucket.cached += row.cached_tokens;
      bucket.completion += row.completion_tokens;
      bucket.gpu += row.gpu_ms / 1000;
    }
    return days.map((d) => ({ label: d, ...buckets.get(d) }));
  }

  function byAdapter(rows) {
    return rows.map((row) => ({
      label: row.adapter === "base" ? `${row.base_model} (base)` : row.adapter,
      prompt: row.prompt_tokens,
      cached: row.cached_tokens,
      completion: row.completion_tokens,
      gpu: row.gpu_ms / 1000,
    }));
  }

  // Prompt tokens include the cached ones: stack the uncached part, the cached part, then completions.
  const TOKEN_SERIES = [
    { name: "Prompt (not cached)", color: COLORS.prompt, value: (b) => b.prompt - b.cached },
    { name: "Prompt (cached)", color: COLORS.cached, value: (b) => b.cached },
    { name: "Completion", color: COLORS.completion, value: (b) => b.completion },
  ];
  const GPU_SERIES = [{ name: "GPU seconds", color: COLORS.gpu, value: (b) => b.gpu }];

  // --- SVG charts -----------------------------------------------------------------------------------

  function el(name, attrs = {}, text = null) {
    const node = document.createElementNS(SVG_NS, name);
    for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
    if (text !== null) node.textContent = text;
    return node;
  }

  // An axis of at most 5 round steps (1, 2, 2.5 or 5 times a power of ten) that covers `value`.
  function niceScale(value) {
    if (!(value > 0)) return { max: 1, ticks: 4 };
    const magnitude = 10 ** Math.floor(Math.log10(value / 5));
    for (const m of [1, 2, 2.5, 5, 10, 20]) {
      const ticks = Math.ceil(value / (m * magnitude) - 1e-9);
      if (ticks <= 5) return { max: ticks * m * magnitude, ticks };
    }
    return { max: value, ticks: 1 };
  }

  function svgFor(container, width, height, summary) {
    container.replaceChildren();
    const svg = el("svg", { viewBox: `0 0 ${width} ${height}`, role: "img", "aria-label": summary });
    container.appendChild(svg);
    return svg;
  }

  function total(bucket, series) {
    return series.reduce((sum, s) => sum + s.value(bucket), 0);
  }

  // Stacked columns, one per bucket (days); every bar has a <title> with its exact value.
  function columnChart(container, buckets, series, format, summary) {
    const W = 560, H = 240, left = 52, right = 8, top = 12, bottom = 26;
    const svg = svgFor(container, W, H, summary);
    const { max, ticks } = niceScale(Math.max(0, ...buckets.map((b) => total(b, series))));
    const plotH = H - top - bottom;
    const y = (v) => top + plotH - (v / max) * plotH;
    for (let i = 0; i <= ticks; i++) {
      const v = (max * i) / ticks;
      svg.appendChild(el("line", { class: i ? "grid-line" : "axis", x1: left, x2: W - right, y1: y(v), y2: y(v) }));
      svg.appendChild(el("text", { x: left - 6, y: y(v) + 4, "text-anchor": "end" }, tick(v)));
    }
    const slot = (W - left - right) / buckets.length;
    const barW = Math.max(2, slot * 0.7);
    buckets.forEach((bucket, i) => {
      const x = left + i * slot + (slot - barW) / 2;
      let base = 0;
      for (const s of series) {
        const v = s.value(bucket);
        if (v <= 0) continue;
        const h = Math.max(1, y(base) - y(base + v));
        const rect = el("rect", { x, y: y(base + v), width: barW, height: h, fill: s.color, "data-series": s.name, "data-label": bucket.label, "data-value": v });
        rect.appendChild(el("title", {}, `${bucket.label} · ${s.name}: ${format(v)}`));
        svg.appendChild(rect);
        base += v;
      }
      if (i % 5 === 0 || i === buckets.length - 1) {
        svg.appendChild(el("text", { x: x + barW / 2, y: H - 8, "text-anchor": "middle" }, bucket.label.slice(5)));
      }
    });
    if (buckets.every((b) => total(b, series) === 0)) {
      svg.appendChild(el("text", { class: "empty", x: W / 2, y: H / 2, "text-anchor": "middle" }, "No usage in this period"));
    }
  }

  // Stacked horizontal bars, one per adapter, labelled on the left with the total at the end.
  function barChart(container, buckets, series, format, summary) {
    const rowH = 30, W = 560, left = 150, right = 90, top = 8;
    const H = Math.max(90, top * 2 + buckets.length * rowH + 18);
    const svg = svgFor(container, W, H, summary);
    if (buckets.length === 0) {
      svg.appendChild(el("text", { class: "empty", x: W / 2, y: H / 2, "text-anchor": "middle" }, "No usage in this period"));
      return;
    }
    const { max, ticks } = niceScale(Math.max(0, ...buckets.map((b) => total(b, series))));
    const plotW = W - left - right;
    const x = (v) => left + (v / max) * plotW;
    for (let i = 0; i <= ticks; i++) {
      const v = (max * i) / ticks;
      svg.appendChild(el("line", { class: i ? "grid-line" : "axis", x1: x(v), x2: x(v), y1: top, y2: H - 18 }));
      svg.appendChild(el("text", { x: x(v), y: H - 4, "text-anchor": "middle" }, tick(v)));
    }
    buckets.forEach((bucket, i) => {
      const yTop = top + i * rowH + 5;
      const label = bucket.label.length > 22 ? `${bucket.label.slice(0, 21)}…` : bucket.label;
      const text = el("text", { x: left - 8, y: yTop + 14, "text-anchor": "end", "data-adapter": bucket.label }, label);
      text.appendChild(el("title", {}, bucket.label));
      svg.appendChild(text);
      let base = 0;
      for (const s of series) {
        const v = s.value(bucket);
        if (v <= 0) continue;
        const rect = el("rect", {
          x: x(base), y: yTop, width: Math.max(1, x(base + v) - x(base)), height: rowH - 10,
          fill: s.color, "data-series": s.name, "data-label": bucket.label, "data-value": v,
        });
        rect.appendChild(el("title", {}, `${bucket.label} · ${s.name}: ${format(v)}`));
        svg.appendChild(rect);
        base += v;
      }
      svg.appendChild(el("text", { class: "value", x: x(base) + 6, y: yTop + 14 }, format(base)));
    });
  }

  // --- rendering ------------------------------------------------------------------------------------

  function setNumber(id, value, text) {
    const node = $(id);
    node.dataset.value = String(value);
    node.textContent = text;
  }

  function renderTotals(rows, p) {
    const sum = (field) => rows.reduce((acc, row) => acc + row[field], 0);
    const prompt = sum("prompt_tokens");
    const completion = sum("completion_tokens");
    const gpu = sum("gpu_ms") / 1000;
    setNumber("total-requests", sum("requests"), integer.format(sum("requests")));
    setNumber("total-tokens", prompt + completion, integer.format(prompt + completion));
    setNumber("total-prompt-tokens", prompt, integer.format(prompt));
    setNumber("total-cached-tokens", sum("cached_tokens"), integer.format(sum("cached_tokens")));
    setNumber("total-completion-tokens", completion, integer.format(completion));
    setNumber("total-gpu-seconds", gpu, seconds(gpu));
    $("period").textContent = `${p.days[0]} – ${p.days[p.days.length - 1]} (UTC)`;
  }

  function renderCharts(hourly, perAdapter, p) {
    const days = byDay(hourly, p.days);
    const adapters = byAdapter(perAdapter);
    const tokens = (v) => `${integer.format(v)} tokens`;
    const tokenTotal = days.reduce((acc, b) => acc + total(b, TOKEN_SERIES), 0);
    const gpuTotal = days.reduce((acc, b) => acc + b.gpu, 0);
    columnChart($("chart-tokens-day"), days, TOKEN_SERIES, tokens, `Tokens per day: ${integer.format(tokenTotal)} in ${DAYS} days`);
    columnChart($("chart-gpu-day"), days, GPU_SERIES, seconds, `GPU seconds per day: ${seconds(gpuTotal)} in ${DAYS} days`);
    const names = adapters.map((a) => a.label).join(", ") || "none";
    barChart($("chart-tokens-adapter"), adapters, TOKEN_SERIES, tokens, `Tokens per adapter: ${names}`);
    barChart($("chart-gpu-adapter"), adapters, GPU_SERIES, seconds, `GPU seconds per adapter: ${names}`);
  }

  function meterRow(id, label, remaining, limit, unit, resetMs) {
    const row = document.createElement("div");
    row.className = "meter-row";
    row.id = id;
    const name = document.createElement("span");
    name.className = "label";
    name.id = `${id}-label`;
    name.textContent = label;
    const bar = document.createElement("div");
    bar.className = "bar";
    bar.setAttribute("role", "meter");
    bar.setAttribute("aria-labelledby", name.id);
    const fill = document.createElement("span");
    bar.appendChild(fill);
    const value = document.createElement("span");
    value.className = "value";
    if (limit === null || remaining === null) {
      value.textContent = "unlimited";
      fill.style.width = "100%";
      bar.setAttribute("aria-valuetext", "unlimited");
    } else {
      const share = limit > 0 ? remaining / limit : 0;
      fill.style.width = `${Math.round(share * 100)}%`;
      bar.classList.toggle("low", share < 0.25);
      bar.classList.toggle("empty", remaining === 0);
      bar.setAttribute("aria-valuemin", "0");
      bar.setAttribute("aria-valuemax", String(limit));
      bar.setAttribute("aria-valuenow", String(remaining));
      const left = `${integer.format(remaining)} / ${integer.format(limit)} ${unit} left`;
      const back = resetMs > 0 ? `all back in ${decimal.format(resetMs / 1000)} s` : "";
      value.textContent = left;
      if (back) {
        const reset = document.createElement("small");
        reset.textContent = back;
        value.appendChild(reset);
      }
      bar.setAttribute("aria-valuetext", back ? `${left}, ${back}` : left);
    }
    row.dataset.remaining = remaining === null ? "" : String(remaining);
    row.dataset.limit = limit === null ? "" : String(limit);
    row.append(name, bar, value);
    return row;
  }

  function renderLimits(body) {
    const l = body.limits;
    const h = body.headroom;
    $("tenant-tier").textContent = `tier: ${body.tier}`;
    const box = $("headroom");
    if (h === null) {
      const p = document.createElement("p");
      p.id = "headroom-unlimited";
      p.textContent = "This tier has no rate limits.";
      box.replaceChildren(p);
    } else {
      box.replaceChildren(
        meterRow("headroom-requests", "Requests", h.remaining_requests, l.rpm, "req/min", h.reset_requests_ms),
        meterRow("headroom-tokens", "Tokens", h.remaining_tokens, l.tpm, "tok/min", h.reset_tokens_ms),
        meterRow("headroom-concurrent", "Concurrent", h.remaining_concurrent, l.max_concurrent, "sequences", 0),
      );
    }
    const cap = l.max_tokens_cap === null ? "no max_tokens cap" : `max_tokens cap ${integer.format(l.max_tokens_cap)}`;
    const over = l.on_limit === "queue" ? `over a limit: queue up to ${decimal.format(l.max_queue_ms / 1000)} s` : "over a limit: 429 at once";
    const inFlight = h === null ? "" : ` · ${h.in_flight} sequences in flight, ${h.queued} queued`;
    $("limits-detail").textContent = `${cap} · ${over}${inFlight}`;
    renderBudget(body.budget);
  }

  // Money (issue 29): balance, spend this period, reserved now and the spend limits, as text only.
  function renderBudget(b) {
    const box = $("budget");
    box.hidden = !b;
    if (!b) return;
    const cur = b.currency.toUpperCase();
    const figures = [];
    if (b.balance !== null) figures.push(["Balance", `${b.balance} ${cur}`]);
    figures.push(["Spent today", `${b.spent_today} ${cur}`], ["Spent this month", `${b.spent_this_month} ${cur}`],
      ["Reserved now", `${b.reserved} ${cur}`]);
    for (const [period, limit] of Object.entries(b.limits)) {
      figures.push([`${period === "day" ? "Daily" : "Monthly"} limit (${limit.hard ? "hard" : "soft"})`,
        `${limit.amount} ${cur}, ${limit.remaining} left`]);
    }
    $("budget-figures").replaceChildren(...figures.flatMap(([name, value]) => {
      const dt = document.createElement("dt");
      dt.textContent = name;
      const dd = document.createElement("dd");
      dd.textContent = value;
      return [dt, dd];
    }));
    $("budget-events").textContent = b.soft_limit_events.length ? `Soft limit passed: ${b.soft_limit_events.join("; ")}` : "";
  }

  function renderModels(body) {
    const rows = body.data.map((card) => {
      const tr = document.createElement("tr");
      tr.dataset.model = card.id;
      const name = document.createElement("td");
      const code = document.createElement("code");
      code.textContent = card.id;
      name.appendChild(code);
      if (!card.parent) {
        const tag = document.createElement("span");
        tag.className = "tag";
        tag.textContent = "base";
        name.appendChild(tag);
      }
      const cells = [card.parent || "—", card.owned_by, new Date(card.created * 1000).toISOString().slice(0, 10)];
      tr.appendChild(name);
      for (const text of cells) {
        const td = document.createElement("td");
        td.textContent = text;
        tr.appendChild(td);
      }
      return tr;
    });
    $("adapters-body").replaceChildren(...rows);
    $("adapters-empty").hidden = body.data.some((card) => card.parent);
  }

  // Batch API (issue 37): the newest batches with their line counts, and the tokens each used in the
  // period (usage grouped by batch; the row with batch_id null is the interactive traffic).
  const tokensIn = (row) => row.prompt_tokens + row.completion_tokens;

  function renderBatches(batches, perBatch) {
    const tokensOf = new Map(perBatch.map((row) => [row.batch_id, tokensIn(row)]));
    const rows = batches.map((batch) => {
      const tr = document.createElement("tr");
      tr.dataset.batch = batch.id;
      tr.dataset.status = batch.status;
      const counts = batch.request_counts || { total: 0, completed: 0, failed: 0 };
      const tokens = tokensOf.get(batch.id) || 0;
      tr.dataset.tokens = String(tokens);
      const id = document.createElement("code");
      id.textContent = batch.id;
      const status = document.createElement("span");
      status.className = `status ${batch.status}`;
      status.textContent = batch.status.replace("_", " ");
      const cells = [id, status,
        `${integer.format(counts.completed)} / ${integer.format(counts.failed)} / ${integer.format(counts.total)}`,
        integer.format(tokens), new Date(batch.created_at * 1000).toISOString().slice(0, 16).replace("T", " ")];
      for (const content of cells) {
        const td = document.createElement("td");
        if (typeof content === "string") td.textContent = content;
        else td.appendChild(content);
        tr.appendChild(td);
      }
      return tr;
    });
    $("batches-body").replaceChildren(...rows);
    $("batches-empty").hidden = batches.length > 0;
    const all = perBatch.reduce((sum, row) => sum + tokensIn(row), 0);
    const batched = perBatch.reduce((sum, row) => sum + (row.batch_id === null ? 0 : tokensIn(row)), 0);
    const share = $("batch-share");
    share.dataset.batchTokens = String(batched);
    share.dataset.allTokens = String(all);
    share.textContent = all > 0
      ? `Batches used ${integer.format(batched)} of ${integer.format(all)} tokens (${decimal.format((100 * batched) / all)}%), at the tier's batch price.`
      : "";
  }

  const bytes = (n) => {
    const units = ["B", "KB", "MB", "GB", "TB"];
    let i = 0;
    while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
    return `${i ? decimal.format(n) : integer.format(n)} ${units[i]}`;
  };

  // Stored responses and files count against one quota: one meter of what is left, the parts below it.
  function renderStorage(storage) {
    if (!storage) {
      $("storage").replaceChildren();
      $("storage-detail").textContent = "";
      return;
    }
    const used = storage.stored_response_bytes + storage.file_bytes;
    const quota = storage.max_stored_response_bytes;
    const left = quota === null ? null : Math.max(0, quota - used);
    const row = meterRow("storage-left", "Stored", left, quota, "bytes", 0);
    row.dataset.used = String(used);
    $("storage").replaceChildren(row);
    $("storage-detail").textContent =
      `${bytes(used)} stored: responses ${bytes(storage.stored_response_bytes)}, files ${bytes(storage.file_bytes)}`;
  }

  // --- session --------------------------------------------------------------------------------------

  function showError(id, message) {
    const node = $(id);
    node.textContent = message;
    node.hidden = !message;
  }

  function showLogin(message) {
    if (refreshTimer !== null) clearInterval(refreshTimer);
    refreshTimer = null;
    sessionStorage.removeItem(KEY_STORAGE);
    $("dashboard").hidden = true;
    $("dashboard").removeAttribute("data-state");
    $("session").hidden = true;
    $("login").hidden = false;
    showError("login-error", message || "");
    $("api-key").focus();
  }

  async function load(key) {
    const dashboard = $("dashboard");
    dashboard.setAttribute("aria-busy", "true");
    dashboard.dataset.state = "loading";
    const p = period();
    try {
      const [hourly, perAdapter, perBatch, batches, limits, models] = await Promise.all([
        api(usagePath(p, "hour"), key),
        api(usagePath(p, "adapter"), key),
        api(usagePath(p, "batch"), key),
        api(`/v1/batches?${new URLSearchParams({ limit: String(BATCHES_SHOWN) })}`, key),
        api("/v1/limits", key),
        api("/v1/models", key),
      ]);
      renderTotals(hourly.data, p);
      renderCharts(hourly.data, perAdapter.data, p);
      renderBatches(batches.data, perBatch.data);
      renderStorage(hourly.storage);
      renderLimits(limits);
      renderModels(models);
      showError("load-error", "");
      dashboard.dataset.state = "ready";
    } catch (error) {
      if (error.status === 401) return showLogin(error.message); // revoked or expired meanwhile
      showError("load-error", error.message);
      dashboard.dataset.state = "error";
    } finally {
      dashboard.setAttribute("aria-busy", "false");
    }
  }

  async function refreshHeadroom() {
    const key = sessionStorage.getItem(KEY_STORAGE);
    if (!key) return;
    try {
      renderLimits(await api("/v1/limits", key));
    } catch (error) {
      if (error.status === 401) showLogin(error.message);
    }
  }

  function enter(key) {
    $("login").hidden = true;
    $("dashboard").hidden = false;
    $("session").hidden = false;
    if (refreshTimer === null) refreshTimer = setInterval(refreshHeadroom, HEADROOM_REFRESH_MS);
    return load(key);
  }

  async function onLogin(event) {
    event.preventDefault();
    const input = $("api-key");
    const key = input.value.trim();
    if (!key) return showError("login-error", "Enter your API key.");
    $("login-button").disabled = true;
    showError("login-error", "");
    try {
      await api("/v1/limits", key); // checks the key; reading limits spends none of the tenant's rpm or credit
      sessionStorage.setItem(KEY_STORAGE, key);
      input.value = "";
      await enter(key);
    } catch (error) {
      showError("login-error", error.message);
    } finally {
      $("login-button").disabled = false;
    }
  }

  document.addEventListener("DOMContentLoaded", () => {
    $("login-form").addEventListener("submit", onLogin);
    $("logout-button").addEventListener("click", () => showLogin(""));
    $("refresh-button").addEventListener("click", () => {
      const key = sessionStorage.getItem(KEY_STORAGE);
      if (key) load(key);
    });
    const saved = sessionStorage.getItem(KEY_STORAGE);
    if (saved) enter(saved);
    else $("api-key").focus();
  });
})();
