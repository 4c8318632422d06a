// The timesliced dashboard in the browser: keeps the server-rendered page current from the
// daemon's Server-Sent Events stream, draws the timeline, and runs the admin actions.
// No framework and no external files: it must work on an air-gapped cluster.
//
// The render functions below produce the same markup as web/macros.html (the first paint),
// and the format functions match timesliced/dashboard/formatting.py: keep them in step.
(function () {
  "use strict";

  const API = "/api/v1";
  const TOKEN_KEY = "timesliced.adminToken";
  const PAGE_EVENTS = 50;
  const body = document.body;
  const page = body.dataset.page || "";
  const pageName = body.dataset.name || "";

  // --- small helpers ------------------------------------------------------------------

  const $ = (selector, root) => (root || document).querySelector(selector);
  const $$ = (selector, root) => Array.from((root || document).querySelectorAll(selector));
  const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
  const esc = (value) => String(value === null || value === undefined ? "" : value).replace(/[&<>"']/g, (c) => ESCAPES[c]);
  const isNum = (v) => typeof v === "number" && Number.isFinite(v);
  const isObj = (v) => v !== null && typeof v === "object" && !Array.isArray(v);
  const obj = (v) => (isObj(v) ? v : {});
  const items = (v) => (Array.isArray(v) ? v.filter(isObj) : []);
  const seg = (name) => encodeURIComponent(String(name));
  const byName = (a, b) => (a < b ? -1 : a > b ? 1 : 0);

  function setHTML(el, html) {
    // Only touch the DOM when the markup changed: no flicker, and selections survive.
    if (el && el._html !== html) {
      el.innerHTML = html;
      el._html = html;
    }
  }

  // --- formatting (the same as timesliced/dashboard/formatting.py) -------------------------------

  function fixed(value, digits) {
    const scale = 10 ** digits;
    return (Math.floor(value * scale + 0.5) / scale).toFixed(digits);
  }

  function fmtBytes(n) {
    if (!isNum(n)) return "—";
    if (Math.abs(n) < 1024) return `${Math.trunc(n)} B`;
    let value = n;
    let unit = "B";
    for (unit of ["KiB", "MiB", "GiB", "TiB", "PiB"]) {
      value /= 1024;
      if (Math.abs(value) < 1024) break;
    }
    const digits = Math.abs(value) < 10 ? 2 : Math.abs(value) < 100 ? 1 : 0;
    return `${fixed(value, digits)} ${unit}`;
  }

  const pad2 = (n) => String(n).padStart(2, "0");

  function fmtDuration(s) {
    if (!isNum(s)) return "—";
    if (s < 1) {
      const ms = s * 1000;
      return `${fixed(ms, ms < 10 ? 1 : 0)} ms`;
    }
    if (s < 60) return `${fixed(s, 1)} s`;
    if (s < 3600) return `${Math.floor(s / 60)} min ${pad2(Math.floor(s % 60))} s`;
    return `${Math.floor(s / 3600)} h ${pad2(Math.floor((s % 3600) / 60))} min`;
  }

  const fmtPct = (x) => (isNum(x) ? `${fixed(x * 100, 0)}%` : "—");
  const fmtGbps = (x) => (isNum(x) ? `${fixed(x, 2)} GB/s` : "—");
  const fmtNum = (x) => (isNum(x) ? String(x) : "—");

  function clock(t) {
    if (!isNum(t)) return "—";
    const d = new Date(t * 1000);
    return `${pad2(d.getHours())}:${pad2(d.getMinutes())}:${pad2(d.getSeconds())}`;
  }

  // The colour of a job everywhere: FNV-1a of its UTF-8 bytes to a hue and a lightness.
  const colours = new Map();
  function jobColor(name) {
    const key = String(name);
    let colour = colours.get(key);
    if (colour === undefined) {
      let h = 0x811c9dc5;
      for (const byte of new TextEncoder().encode(key)) h = Math.imul(h ^ byte, 0x01000193) >>> 0;
      colour = `hsl(${h % 360}, 62%, ${40 + ((h >>> 12) % 3) * 8}%)`;
      colours.set(key, colour);
    }
    return colour;
  }

  // --- markup shared with web/macros.html ----------------------------------------------

  const chip = (name) =>
    `<svg class="chip" viewBox="0 0 10 10" aria-hidden="true"><rect width="10" height="10" rx="2" fill="${jobColor(name)}"/></svg>`;
  const jobLink = (name) => `<a class="job" href="/jobs/${seg(name)}">${chip(name)}${esc(name)}</a>`;
  const groupLink = (name) => `<a class="group" href="/groups/${seg(name)}">${esc(name)}</a>`;
  const dash = () => `<span class="muted">—</span>`;

  const stateBadges = (g) =>
    `<span class="badge state-${esc(g.state)}">${esc(g.state)}</span>` +
    (g.draining ? `<span class="badge draining">draining</span>` : "");

  const holderCell = (g) =>
    (g.holder ? jobLink(g.holder) : dash()) +
    (g.switching_to ? `<span class="switching">switching to</span>${jobLink(g.switching_to)}` : "");

  const queueCell = (g) =>
    items(g.queue).length
      ? `<ol class="inline-queue">${items(g.queue).map((w) => `<li>${jobLink(w.job)}</li>`).join("")}</ol>`
      : `<span class="muted">empty</span>`;

  const locBadges = (j) =>
    `<span class="badge loc-${esc(j.location)}">${esc(j.location)}</span>` +
    (j.faulted ? `<span class="badge faulted" title="${esc(j.faulted)}">faulted</span>` : "") +
    (j.park_refused ? `<span class="badge refused" title="${esc(j.park_refused)}">park refused</span>` : "");

  function meter(x) {
    const width = isNum(x) ? fixed(Math.min(Math.max(x, 0), 1) * 100, 1) : "0.0";
    return (
      `<svg class="meter" viewBox="0 0 100 6" preserveAspectRatio="none" aria-hidden="true">` +
      `<rect class="meter-bg" width="100" height="6"/><rect class="meter-fill" width="${width}" height="6"/></svg>`
    );
  }

  const nodeMeta = (st) => `<span class="node">${esc(st.node || "")}</span><span class="muted">${esc(st.backend || "")}</span>`;

  function nodesRows(st) {
    const t = obj(st.telemetry);
    return (
      `<tr data-node="${esc(st.node)}"><td>${esc(st.node)}</td><td>${esc(st.version)}</td><td>${esc(st.backend)}</td>` +
      `<td class="num">${fmtNum(items(st.devices).length)}</td><td class="num">${fmtNum(st.connections)}</td>` +
      `<td class="num">${fmtDuration(st.uptime_s)}</td>` +
      `<td>${esc(t.source || "—")}${t.reason ? ` <span class="muted">(${esc(t.reason)})</span>` : ""}</td></tr>`
    );
  }

  function gpuViews(st) {
    const tele = new Map(items(obj(st.telemetry).gpus).map((g) => [g.index, g]));
    const devices = items(st.devices);
    const known = new Set(devices.map((d) => d.index));
    const indexes = devices.map((d) => d.index).concat([...tele.keys()].filter((i) => !known.has(i)));
    return indexes.map((index) => {
      const device = devices.find((d) => d.index === index) || {};
      const t = tele.get(index) || {};
      let total = isNum(t.memory_total) ? t.memory_total : device.capacity;
      total = isNum(total) && total > 0 ? total : 0;
      const jobs = obj(device.jobs);
      const onDevice = Object.entries(jobs)
        .filter(([, info]) => isObj(info) && info.location !== "parked" && isNum(info.bytes))
        .map(([job, info]) => [String(job), info.bytes, info.location])
        .sort((a, b) => byName(a[0], b[0]));
      const jobsBytes = onDevice.reduce((sum, s) => sum + s[1], 0);
      const used = t.memory_used;
      const other = isNum(used) && used > jobsBytes ? used - jobsBytes : 0;
      const segments = [];
      let x = 0.0;
      for (const [job, nbytes, location] of other > 0 ? onDevice.concat([["", other, "other"]]) : onDevice) {
        const width = total ? (nbytes / total) * 1000 : 0.0;
        segments.push({ job, bytes: nbytes, location, x: fixed(x, 1), width: fixed(width, 1) });
        x += width;
      }
      const parked = Object.entries(jobs)
        .filter(([, info]) => isObj(info) && info.location === "parked")
        .map(([job]) => String(job))
        .sort(byName);
      return {
        index,
        name: t.name || `GPU ${index}`,
        duty_now: t.duty_now,
        duty_window: t.duty_window,
        window_s: t.window_s,
        total,
        used: jobsBytes + other,
        segments,
        parked,
      };
    });
  }

  function gpuCards(st) {
    const views = gpuViews(st);
    if (!views.length) return `<p class="empty">no GPUs</p>`;
    return views
      .map((v) => {
        const bar = v.segments
          .map((s) =>
            s.job
              ? `<rect class="seg" x="${s.x}" width="${s.width}" height="14" fill="${jobColor(s.job)}" data-job="${esc(s.job)}"><title>${esc(s.job)}: ${fmtBytes(s.bytes)}</title></rect>`
              : `<rect class="seg seg-other" x="${s.x}" width="${s.width}" height="14"><title>other: ${fmtBytes(s.bytes)}</title></rect>`
          )
          .join("");
        const legend =
          v.segments
            .map((s) =>
              s.job
                ? `<li>${jobLink(s.job)}<span class="muted">${fmtBytes(s.bytes)}${s.location !== "resident" ? ` ${esc(s.location)}` : ""}</span></li>`
                : `<li><span class="chip-other"></span>other<span class="muted">${fmtBytes(s.bytes)}</span></li>`
            )
            .join("") + v.parked.map((job) => `<li class="parked">${jobLink(job)}<span class="muted">parked</span></li>`).join("");
        const windowLabel = isNum(v.window_s) ? `${fixed(v.window_s, 0)} s` : "window";
        return (
          `<article class="gpu" data-gpu="${esc(v.index)}"><h3>GPU ${esc(v.index)} <span class="muted">${esc(v.name)}</span></h3>` +
          `<div class="duty"><span class="label">duty now</span>${meter(v.duty_now)}<span class="val">${fmtPct(v.duty_now)}</span></div>` +
          `<div class="duty"><span class="label">duty ${windowLabel}</span>${meter(v.duty_window)}<span class="val">${fmtPct(v.duty_window)}</span></div>` +
          `<svg class="membar" viewBox="0 0 1000 14" preserveAspectRatio="none" role="img" aria-label="memory of GPU ${esc(v.index)}"><rect class="membar-bg" width="1000" height="14"/>${bar}</svg>` +
          `<p class="mem">${fmtBytes(v.used)} of ${fmtBytes(v.total)}</p><ul class="legend">${legend}</ul></article>`
        );
      })
      .join("");
  }

  function groupsRows(st) {
    const groups = items(st.groups);
    if (!groups.length) return `<tr><td colspan="11" class="empty">no groups yet: a job creates its group when it registers</td></tr>`;
    return groups
      .map(
        (g) =>
          `<tr data-group="${esc(g.group)}"><td>${groupLink(g.group)}</td><td>${esc((g.gpus || []).join(", "))}</td>` +
          `<td>${stateBadges(g)}</td><td class="holder">${holderCell(g)}</td>` +
          `<td class="num">${g.holder ? fmtDuration(g.held_s) : "—"}</td><td class="queue">${queueCell(g)}</td>` +
          `<td class="num">${fmtNum(g.fence)}</td><td class="num">${fmtNum(g.switches)}</td>` +
          `<td class="num">${fmtDuration(g.median_switch_s)}</td><td class="num">${fmtDuration(g.median_wait_s)}</td>` +
          `<td class="num">${fmtPct(g.lock_duty)}</td></tr>`
      )
      .join("");
  }

  function jobsRows(st) {
    const jobs = items(st.jobs);
    if (!jobs.length) return `<tr><td colspan="9" class="empty">no jobs registered</td></tr>`;
    return jobs
      .map(
        (j) =>
          `<tr data-job="${esc(j.job)}"><td>${jobLink(j.job)}</td><td>${groupLink(j.group)}</td><td>${locBadges(j)}</td>` +
          `<td>${esc(j.park || "—")}</td><td class="num">${fmtNum(j.slices)}</td>` +
          `<td class="num">${fmtDuration(j.gpu_seconds)}</td><td class="num">${fmtDuration(j.median_wait_s)}</td>` +
          `<td class="num">${fmtBytes(j.bytes_moved)}</td><td class="num">${fmtBytes(j.parked_bytes)}</td></tr>`
      )
      .join("");
  }

  function hostRows(st) {
    const nodes = items(st.host);
    if (!nodes.length) return `<tr><td colspan="8" class="empty">no reading of the host yet: parks are not limited</td></tr>`;
    const members = Array.isArray(obj(st.cluster).members) ? obj(st.cluster).members : [];
    return nodes
      .map((h) => {
        const pools = Object.entries(obj(h.pools));
        const poolText = pools.length
          ? pools.map(([pool, p]) => `${esc(pool)}: ${fmtBytes(obj(p).parked)} of ${fmtBytes(obj(p).budget)}`).join(", ")
          : "—";
        const node = isNum(h.slot) && h.slot < members.length ? members[h.slot] : h.slot;
        return (
          `<tr data-slot="${esc(h.slot)}"><td>${esc(node)}</td><td class="num">${fmtBytes(h.budget)}</td>` +
          `<td class="num">${fmtBytes(h.parked)}</td><td class="num">${fmtBytes(h.reserved)}</td>` +
          `<td class="num">${fmtBytes(h.freeing)}</td><td class="num">${fmtBytes(h.room)}</td>` +
          `<td class="num">${fmtBytes(h.limit)}</td><td>${poolText}</td></tr>`
        );
      })
      .join("");
  }

  function hostReading(st) {
    const r = obj(st.host_memory);
    if (!isNum(r.age_s)) return "This node has not read its host's memory yet.";
    const cg = isObj(r.cgroup) ? r.cgroup : null;
    const tmpfs = isObj(r.tmpfs) ? r.tmpfs : null;
    return (
      `This node: MemAvailable ${fmtBytes(r.available)}, ${fmtBytes(r.margin)} kept free` +
      (cg ? `; cgroup ${esc(cg.path)} ${fmtBytes(cg.used)} of ${isNum(cg.limit) ? fmtBytes(cg.limit) : "no limit"}` : "") +
      (tmpfs ? `; tmpfs ${esc(tmpfs.path)} ${fmtBytes(tmpfs.free)} free of ${fmtBytes(tmpfs.size)}` : "") +
      (r.error ? `; <span class="fault">${esc(r.error)}</span>` : "")
    );
  }

  function groupDetail(st, name) {
    const group = items(st.groups).find((g) => g.group === name);
    if (!group) return null;
    const members = items(st.jobs)
      .filter((j) => j.group === name && "job" in j)
      .map((j) => j.job);
    const perJob = obj(obj(st.moves).jobs);
    let nbytes = 0.0;
    let seconds = 0.0;
    for (const job of members) {
      const m = perJob[job];
      if (isObj(m) && isNum(m.nbytes) && isNum(m.seconds)) {
        nbytes += m.nbytes;
        seconds += m.seconds;
      }
    }
    return Object.assign({}, group, { members, gbps: seconds > 0 ? nbytes / seconds / 1e9 : null });
  }

  const groupHead = (g) =>
    stateBadges(g) + (isNum(g.deferred) && g.deferred > 0 ? `<span class="badge deferred">${esc(g.deferred)} deferred</span>` : "");

  const groupSummary = (g) =>
    `<dt>GPUs</dt><dd>${esc((g.gpus || []).join(", "))}</dd>` +
    `<dt>Holder</dt><dd class="holder">${holderCell(g)}</dd>` +
    `<dt>Held for</dt><dd>${g.holder ? fmtDuration(g.held_s) : "—"}</dd>` +
    `<dt>Fence</dt><dd>${fmtNum(g.fence)}</dd>` +
    `<dt>Draining</dt><dd>${g.draining ? "yes" : "no"}${isNum(g.deferred) && g.deferred > 0 ? ` (${esc(g.deferred)} requests deferred)` : ""}</dd>` +
    `<dt>Maximum slice</dt><dd>${sliceCell(g)}</dd>` +
    (g.waiting_for ? `<dt>Next waits for</dt><dd class="waiting">${esc(g.waiting_for)}</dd>` : "");

  const sliceCell = (g) =>
    !isNum(g.max_slice_s)
      ? "none"
      : `${fmtDuration(g.max_slice_s)}, then ${esc(g.slice_action)}` +
        (isNum(g.overdue_s) ? ` <span class="badge preempted">overdue ${fmtDuration(g.overdue_s)}</span>` : "") +
        (g.preemptions ? ` (${fmtNum(g.preemptions)} preempted)` : "");

  const queueNote = (w) =>
    w.preempted
      ? ` <span class="badge preempted">preempted</span>`
      : isNum(w.kept_for_s)
        ? ` <span class="badge kept">turn kept ${fmtDuration(w.kept_for_s)}</span>`
        : "";

  function queueRows(g) {
    const queue = items(g.queue);
    if (!queue.length) return `<tr><td colspan="4" class="empty">nobody is waiting</td></tr>`;
    return queue
      .map(
        (w, i) =>
          `<tr data-job="${esc(w.job)}"><td class="num">${i + 1}</td><td>${jobLink(w.job)}${queueNote(w)}</td>` +
          `<td class="num">${fmtDuration(w.waited_s)}</td><td class="num">${fmtNum(w.requests)}</td></tr>`
      )
      .join("");
  }

  const groupStats = (g) =>
    `<dt>Grants</dt><dd>${fmtNum(g.grants)}</dd><dt>Switches</dt><dd>${fmtNum(g.switches)}</dd>` +
    `<dt>Median switch</dt><dd>${fmtDuration(g.median_switch_s)}</dd><dt>p95 switch</dt><dd>${fmtDuration(g.p95_switch_s)}</dd>` +
    `<dt>Bytes moved</dt><dd>${fmtBytes(g.bytes_moved)}</dd><dt>Copy rate</dt><dd>${fmtGbps(g.gbps)}</dd>` +
    `<dt>Median queue wait</dt><dd>${fmtDuration(g.median_wait_s)}</dd><dt>Lock duty</dt><dd>${fmtPct(g.lock_duty)}</dd>`;

  function memberRows(st, g) {
    const jobs = items(st.jobs).filter((j) => j.group === g.group);
    if (!jobs.length) return `<tr><td colspan="5" class="empty">no jobs</td></tr>`;
    return jobs
      .map(
        (j) =>
          `<tr data-job="${esc(j.job)}"><td>${jobLink(j.job)}</td><td>${locBadges(j)}</td><td class="num">${fmtNum(j.slices)}</td>` +
          `<td class="num">${fmtDuration(j.gpu_seconds)}</td><td class="num">${fmtDuration(j.median_wait_s)}</td></tr>`
      )
      .join("");
  }

  function jobDetail(st, name) {
    const job = items(st.jobs).find((j) => j.job === name);
    if (!job) return null;
    const lock = { state: "idle", position: null, waited_s: null, held_s: null };
    const group = items(st.groups).find((g) => g.group === String(job.group));
    if (group) {
      const queue = items(group.queue);
      const position = queue.findIndex((w) => w.job === name);
      if (group.holder === name) Object.assign(lock, { state: "holding", held_s: group.held_s });
      else if (group.switching_to === name) lock.state = "switching";
      else if (position >= 0) Object.assign(lock, { state: "waiting", position: position + 1, waited_s: queue[position].waited_s });
    }
    const residency = [];
    for (const device of items(st.devices)) {
      const info = obj(device.jobs)[name];
      if (isObj(info)) residency.push({ gpu: device.index, bytes: info.bytes, location: info.location });
    }
    const gpus = items(obj(st.telemetry).gpus);
    const processes = (Array.isArray(job.pids) ? job.pids : []).map((pid) => {
      const found = {};
      for (const gpu of gpus) {
        const nbytes = obj(gpu.processes)[String(pid)];
        if (isNum(nbytes)) found[String(gpu.index)] = nbytes;
      }
      return { pid, gpus: found };
    });
    const moves = obj(st.moves);
    const recent = items(moves.recent)
      .filter((m) => m.job === name)
      .slice(-20);
    return Object.assign({}, job, { lock, residency, processes, moves: { summary: obj(moves.jobs)[name], recent } });
  }

  function lockText(lock) {
    if (lock.state === "waiting") return `waiting #${lock.position}`;
    if (lock.state === "switching") return "switching in";
    return esc(lock.state);
  }

  const jobHead = (j) => `${locBadges(j)}<span class="badge lock-${esc(j.lock.state)}">${lockText(j.lock)}</span>`;

  const WHERE = {
    resident: "on its GPUs",
    parked: "in host memory (parked)",
    parking: "moving to host memory",
    restoring: "moving back to its GPUs",
  };

  function jobSummary(j) {
    const lock = j.lock;
    let lockLine = "neither holding nor waiting";
    if (lock.state === "holding") lockLine = `holding it for ${fmtDuration(lock.held_s)}`;
    else if (lock.state === "waiting") lockLine = `waiting, #${lock.position} in the queue, for ${fmtDuration(lock.waited_s)}`;
    else if (lock.state === "switching") lockLine = "being switched in";
    const where = Object.prototype.hasOwnProperty.call(WHERE, j.location) ? WHERE[j.location] : j.location;
    return (
      `<dt>Group</dt><dd>${groupLink(j.group)}</dd><dt>Lock</dt><dd>${lockLine}</dd>` +
      `<dt>State lives</dt><dd>${esc(where)}</dd><dt>Parking method</dt><dd>${esc(j.park || "—")}</dd>` +
      `<dt>Sessions</dt><dd>${fmtNum(j.sessions)}</dd><dt>Slices</dt><dd>${fmtNum(j.slices)}</dd>` +
      `<dt>Snapshots / restores</dt><dd>${fmtNum(j.snapshots)} / ${fmtNum(j.restores)}</dd>` +
      `<dt>GPU time held</dt><dd>${fmtDuration(j.gpu_seconds)}</dd>` +
      `<dt>Median queue wait</dt><dd>${fmtDuration(j.median_wait_s)}</dd><dt>Bytes moved</dt><dd>${fmtBytes(j.bytes_moved)}</dd>` +
      `<dt>Parked in host memory</dt><dd>${fmtBytes(j.parked_bytes)}</dd>` +
      (j.park_refused ? `<dt>Park refused</dt><dd class="fault">${esc(j.park_refused)}</dd>` : "") +
      (j.faulted ? `<dt>Fault</dt><dd class="fault">${esc(j.faulted)}</dd>` : "")
    );
  }

  function jobStateRows(j) {
    if (!j.residency.length) return `<tr><td colspan="4" class="empty">no device memory</td></tr>`;
    const measured = obj(j.measured);
    return j.residency
      .map(
        (r) =>
          `<tr><td>GPU ${esc(r.gpu)}</td><td class="num">${fmtBytes(r.bytes)}</td>` +
          `<td><span class="badge loc-${esc(r.location)}">${esc(r.location)}</span></td>` +
          `<td class="num">${fmtBytes(measured[String(r.gpu)])}</td></tr>`
      )
      .join("");
  }

  function processRows(j) {
    if (!j.processes.length) return `<tr><td colspan="2" class="empty">no processes registered</td></tr>`;
    return j.processes
      .map((p) => {
        const entries = Object.entries(p.gpus);
        const mem = entries.length ? entries.map(([gpu, n]) => `GPU ${esc(gpu)}: ${fmtBytes(n)}`).join(", ") : "—";
        return `<tr><td class="num">${fmtNum(p.pid)}</td><td>${mem}</td></tr>`;
      })
      .join("");
  }

  function moveRows(j) {
    const recent = j.moves.recent.slice().reverse();
    if (!recent.length) return `<tr><td colspan="4" class="empty">no moves yet</td></tr>`;
    return recent
      .map(
        (m) =>
          `<tr><td>${esc(m.kind)}</td><td class="num">${fmtBytes(m.nbytes)}</td>` +
          `<td class="num">${fmtDuration(m.seconds)}</td><td class="num">${fmtGbps(m.gbps)}</td></tr>`
      )
      .join("");
  }

  function moveSummary(j) {
    const s = obj(j.moves.summary);
    return (
      `<dt>Moves</dt><dd>${fmtNum(s.count)}</dd><dt>Snapshots / restores</dt><dd>${fmtNum(s.snapshots)} / ${fmtNum(s.restores)}</dd>` +
      `<dt>Bytes</dt><dd>${fmtBytes(s.nbytes)}</dd><dt>Copy time</dt><dd>${fmtDuration(s.seconds)}</dd>` +
      `<dt>Median rate</dt><dd>${fmtGbps(s.median_gbps)}</dd>`
    );
  }

  function eventItem(e) {
    return (
      `<li data-id="${esc(e.id)}"><time data-t="${esc(e.t)}">${clock(e.t)}</time> <span class="ev ev-${esc(e.kind)}">${esc(e.kind)}</span>` +
      (e.group ? ` ${groupLink(e.group)}` : "") +
      (e.job ? ` ${jobLink(e.job)}` : "") +
      (e.detail ? ` <span class="detail">${esc(e.detail)}</span>` : "") +
      `</li>`
    );
  }

  // --- banners and the live indicator ------------------------------------------------

  function banner(id, text) {
    const el = $(id);
    if (!el) return;
    if (text) {
      el.textContent = text;
      el.hidden = false;
    } else {
      el.hidden = true;
    }
  }

  let connected = null;
  function setConnected(on) {
    if (connected === on) return;
    connected = on;
    const conn = $("#conn-banner");
    if (conn) conn.hidden = on;
    const live = $("#live");
    if (live) {
      live.dataset.state = on ? "live" : "offline";
      live.textContent = on ? "live" : "offline";
    }
    body.dataset.connected = on ? "yes" : "no";
  }

  // --- rendering a status document ----------------------------------------------------

  let updates = 0;
  function onStatus(st) {
    banner("#problem-banner", "");
    setHTML($("#node-meta"), nodeMeta(st));
    if (page === "overview") {
      setHTML($("#nodes-body"), nodesRows(st));
      setHTML($("#gpus"), gpuCards(st));
      setHTML($("#groups-body"), groupsRows(st));
      setHTML($("#jobs-body"), jobsRows(st));
      setHTML($("#host-body"), hostRows(st));
      setHTML($("#host-reading"), hostReading(st));
    } else if (page === "group") {
      const g = groupDetail(st, pageName);
      banner("#gone-banner", g ? "" : `The group ${pageName} no longer exists on this daemon; this is its last known state.`);
      if (g) {
        setHTML($("#group-head"), groupHead(g));
        setHTML($("#group-summary"), groupSummary(g));
        setHTML($("#group-stats"), groupStats(g));
        setHTML($("#group-queue-body"), queueRows(g));
        setHTML($("#group-members-body"), memberRows(st, g));
        updateGroupButtons(st, g);
      }
    } else if (page === "job") {
      const j = jobDetail(st, pageName);
      banner("#gone-banner", j ? "" : `The job ${pageName} is no longer registered; this is its last known state.`);
      if (j) {
        setHTML($("#job-head"), jobHead(j));
        setHTML($("#job-summary"), jobSummary(j));
        setHTML($("#job-moves-summary"), moveSummary(j));
        setHTML($("#job-state-body"), jobStateRows(j));
        setHTML($("#job-processes-body"), processRows(j));
        setHTML($("#job-moves-body"), moveRows(j));
        setDisabled("#job-actions", "resume", !j.faulted);
      }
    }
    updates += 1;
    body.dataset.updates = String(updates);
    const live = $("#live");
    if (live) live.title = `updated ${clock(Date.now() / 1000)}`;
  }

  function onEvents(events) {
    const list = $("#events-list");
    if (!list) return;
    const fresh = events.filter(
      (e) => (page !== "group" || e.group === pageName) && (page !== "job" || e.job === pageName)
    );
    if (!fresh.length) return;
    const placeholder = $("li.empty", list);
    if (placeholder) placeholder.remove();
    for (const e of fresh) {
      if ($(`li[data-id="${CSS.escape(String(e.id))}"]`, list)) continue;
      list.insertAdjacentHTML("afterbegin", eventItem(e));
    }
    while (list.children.length > PAGE_EVENTS) list.lastElementChild.remove();
  }

  function hydrateTimes(root) {
    for (const el of $$("time[data-t]", root)) {
      const t = Number(el.dataset.t);
      if (Number.isFinite(t) && el.dataset.t !== "") el.textContent = clock(t);
    }
  }

  // --- the timeline -------------------------------------------------------------------

  const timeline = { now: 0, window_s: 600, groups: [], spans: new Map() };
  const spanKey = (s) => `${s.group}\u0000${s.kind}\u0000${s.job}\u0000${s.start}`;

  function mergeTimeline(data) {
    if (data.full) timeline.spans.clear();
    timeline.now = isNum(data.now) ? data.now : timeline.now;
    timeline.window_s = isNum(data.window_s) ? data.window_s : timeline.window_s;
    timeline.groups = items(data.groups);
    for (const span of items(data.spans)) timeline.spans.set(spanKey(span), span);
    const start = timeline.now - timeline.window_s;
    for (const [key, span] of timeline.spans) {
      if (span.end !== null && span.end !== undefined && span.end < start) timeline.spans.delete(key);
    }
    drawTimeline();
  }

  const TICKS = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200];

  function drawTimeline() {
    const box = $("#timeline");
    if (!box) return;
    const width = Math.max(box.clientWidth || 0, 480);
    const labelW = 170;
    const axisH = 24;
    const laneH = 34;
    const gap = 8;
    const right = 14;
    const groups = timeline.groups;
    const height = axisH + Math.max(groups.length, 1) * (laneH + gap) + 6;
    const t1 = timeline.now;
    const t0 = t1 - timeline.window_s;
    const plotW = width - labelW - right;
    const x = (t) => labelW + ((Math.min(Math.max(t, t0), t1) - t0) / (t1 - t0)) * plotW;
    const parts = [
      `<svg id="timeline-svg" class="timeline-svg" viewBox="0 0 ${width} ${height}" width="${width}" height="${height}" role="img" aria-label="lock timeline">`,
      `<defs><pattern id="hatch" width="6" height="6" patternUnits="userSpaceOnUse" patternTransform="rotate(45)">` +
        `<rect class="hatch-bg" width="6" height="6"/><line class="hatch-line" x1="0" y1="0" x2="0" y2="6"/></pattern></defs>`,
    ];
    const step = TICKS.find((s) => timeline.window_s / s <= 8) || 86400;
    for (let t = Math.ceil(t0 / step) * step; t <= t1; t += step) {
      const tx = x(t).toFixed(1);
      parts.push(
        `<line class="tick" x1="${tx}" y1="${axisH - 4}" x2="${tx}" y2="${height}"/>` +
          `<text class="tick-label" x="${tx}" y="${axisH - 8}" text-anchor="middle">${clock(t)}</text>`
      );
    }
    if (!groups.length) {
      parts.push(`<text class="lane-empty" x="${labelW}" y="${axisH + laneH / 2 + 4}">no groups yet</text>`);
    }
    const spans = Array.from(timeline.spans.values());
    const seenJobs = new Set();
    groups.forEach((g, i) => {
      const y = axisH + i * (laneH + gap);
      let held = 0;
      const rects = [];
      for (const s of spans) {
        if (s.group !== g.group) continue;
        const end = s.end === null || s.end === undefined ? t1 : s.end;
        if (end < t0 || s.start > t1) continue;
        const sx = x(s.start);
        const w = Math.max(x(end) - sx, 1);
        const dur = end - s.start;
        const when = `${clock(s.start)}, ${fmtDuration(dur)}${s.end === null || s.end === undefined ? " so far" : ""}`;
        if (s.kind === "held") {
          held += Math.min(end, t1) - Math.max(s.start, t0);
          seenJobs.add(s.job);
          rects.push(
            `<rect class="span held" data-kind="held" data-job="${esc(s.job)}" x="${sx.toFixed(1)}" y="${y + 4}" width="${w.toFixed(1)}" height="${laneH - 8}" fill="${jobColor(s.job)}"><title>${esc(s.job)} held ${esc(g.group)}: ${when}</title></rect>`
          );
        } else {
          rects.push(
            `<rect class="span switching" data-kind="switching" data-job="${esc(s.job)}" x="${sx.toFixed(1)}" y="${y + 4}" width="${w.toFixed(1)}" height="${laneH - 8}" fill="url(#hatch)"><title>switching to ${esc(s.job)}: ${when}</title></rect>`
          );
        }
      }
      parts.push(
        `<g class="lane" data-group="${esc(g.group)}">` +
          `<a href="/groups/${seg(g.group)}"><text class="lane-label" x="8" y="${y + 15}">${esc(g.group)}</text></a>` +
          `<text class="lane-sub" x="8" y="${y + 29}">GPU ${esc((g.gpus || []).join(", "))} · held ${fmtPct(held / timeline.window_s)}</text>` +
          `<rect class="idle" x="${labelW}" y="${y + 4}" width="${plotW.toFixed(1)}" height="${laneH - 8}"><title>idle</title></rect>` +
          rects.join("") +
          `</g>`
      );
    });
    parts.push(`<line class="now" x1="${(labelW + plotW).toFixed(1)}" y1="${axisH - 4}" x2="${(labelW + plotW).toFixed(1)}" y2="${height}"/>`);
    parts.push(`</svg>`);
    box.innerHTML = parts.join("");
    const legend = $("#timeline-legend");
    if (legend) {
      setHTML(
        legend,
        Array.from(seenJobs)
          .sort(byName)
          .map((job) => `<li>${jobLink(job)}</li>`)
          .join("") +
          `<li><svg class="chip" viewBox="0 0 10 10" aria-hidden="true"><rect class="hatch-chip" width="10" height="10" rx="2"/></svg>switching</li>` +
          `<li><svg class="chip" viewBox="0 0 10 10" aria-hidden="true"><rect class="idle" width="10" height="10" rx="2"/></svg>idle</li>`
      );
    }
    const summary = $("#timeline-summary");
    if (summary) summary.textContent = `${spans.length} spans · up to ${clock(t1)}`;
  }

  function initTimeline() {
    const data = $("#timeline-data");
    if (data) {
      try {
        mergeTimeline(Object.assign(JSON.parse(data.textContent), { full: true }));
      } catch (err) {
        banner("#problem-banner", "The timeline data on this page could not be read.");
      }
    }
    const select = $("#window");
    if (select) {
      select.addEventListener("change", () => {
        const window_s = Number(select.value);
        const url = new URL(location.href);
        url.searchParams.set("window", String(window_s));
        history.replaceState(null, "", url);
        timeline.window_s = window_s;
        live.timelineWindow = window_s;
        live.connect(); // the first message of the new stream is the full window
      });
    }
    let resize = 0;
    window.addEventListener("resize", () => {
      clearTimeout(resize);
      resize = setTimeout(drawTimeline, 100);
    });
  }

  // --- the live stream --------------------------------------------------------------

  const live = {
    source: null,
    after: body.dataset.after === "" ? null : Number(body.dataset.after),
    timelineWindow: null,
    interval: Number(body.dataset.interval) || 1,
    lastMessage: 0,
    retry: 1000,
    timer: 0,

    url() {
      const params = new URLSearchParams();
      if (this.after !== null && Number.isFinite(this.after)) params.set("after", String(this.after));
      if (this.timelineWindow !== null) params.set("timeline", String(this.timelineWindow));
      return `${API}/stream?${params}`;
    },

    connect() {
      clearTimeout(this.timer);
      if (this.source) this.source.close();
      const source = new EventSource(this.url());
      this.source = source;
      this.lastMessage = Date.now();
      source.addEventListener("open", () => {
        this.retry = 1000;
      });
      source.addEventListener("error", () => {
        if (this.source !== source) return;
        setConnected(false);
        // The browser retries by itself unless the server refused the stream (503 when full).
        if (source.readyState === EventSource.CLOSED) this.later();
      });
      const handle = (name, fn) =>
        source.addEventListener(name, (message) => {
          if (this.source !== source) return;
          this.lastMessage = Date.now();
          let data;
          try {
            data = JSON.parse(message.data);
          } catch (err) {
            return;
          }
          fn(data, message);
        });
      handle("hello", (data) => {
        if (isNum(data.interval_s)) this.interval = data.interval_s;
      });
      handle("status", (data) => {
        setConnected(true);
        onStatus(data);
      });
      handle("events", (data, message) => {
        const id = Number(message.lastEventId);
        if (Number.isFinite(id)) this.after = id;
        onEvents(items(data.events));
      });
      handle("timeline", (data) => mergeTimeline(data));
      handle("problem", (data) => {
        setConnected(true);
        const error = obj(data.error);
        banner("#problem-banner", `The daemon could not produce its status: ${error.message || "unknown error"}`);
      });
    },

    later() {
      clearTimeout(this.timer);
      this.timer = setTimeout(() => this.connect(), this.retry);
      this.retry = Math.min(this.retry * 2, 15000);
    },

    watch() {
      // A stream that stays open but goes quiet (a stuck proxy) counts as disconnected.
      setInterval(() => {
        const quiet = Date.now() - this.lastMessage;
        if (this.source && this.source.readyState === EventSource.OPEN && quiet > Math.max(5000, this.interval * 4000)) {
          setConnected(false);
          this.connect();
        }
      }, 1000);
    },
  };

  // --- admin --------------------------------------------------------------------------

  function storedToken() {
    try {
      return sessionStorage.getItem(TOKEN_KEY);
    } catch (err) {
      return null;
    }
  }

  function forgetToken() {
    try {
      sessionStorage.removeItem(TOKEN_KEY);
    } catch (err) {
      // storage unavailable: nothing was kept
    }
    body.classList.remove("admin-on");
  }

  async function checkToken(token) {
    const response = await fetch(`${API}/admin`, { headers: { Authorization: `Bearer ${token}` }, cache: "no-store" });
    const data = await response.json();
    return data.authorized === true;
  }

  function adminMessage(text) {
    const msg = $("#admin-msg");
    if (msg) msg.textContent = text;
  }

  function initAdmin() {
    if (body.dataset.admin !== "on" || !$("#admin")) return;
    const input = $("#admin-token");
    const unlock = async () => {
      const token = input.value.trim();
      input.value = "";
      if (!token) return;
      try {
        if (await checkToken(token)) {
          sessionStorage.setItem(TOKEN_KEY, token);
          body.classList.add("admin-on");
          adminMessage("");
          $("#admin").open = false;
        } else {
          adminMessage("That token was not accepted.");
        }
      } catch (err) {
        adminMessage("The daemon could not be reached.");
      }
    };
    $("#admin-unlock").addEventListener("click", unlock);
    input.addEventListener("keydown", (event) => {
      if (event.key === "Enter") {
        event.preventDefault();
        unlock();
      }
    });
    $("#admin-lock").addEventListener("click", () => {
      forgetToken();
      adminMessage("The token is forgotten.");
    });
    const token = storedToken();
    if (token) {
      body.classList.add("admin-on");
      checkToken(token)
        .then((ok) => {
          if (!ok) forgetToken();
        })
        .catch(() => {});
    }
  }

  const ACTIONS = {
    release: { done: "Force-released", confirm: "Confirm force release" },
    drain: { done: "Draining" },
    resume: { done: "Resumed" },
  };

  function setDisabled(panel, action, disabled) {
    const button = $(`${panel} button[data-action="${action}"]`);
    if (button && !button.dataset.busy) button.disabled = disabled;
  }

  function updateGroupButtons(st, g) {
    // Resume undoes a drain and clears the faults of the group's jobs: it has work when either is there.
    const faulted = items(st.jobs).some((j) => j.group === g.group && j.faulted);
    setDisabled("#group-actions", "release", !g.holder);
    setDisabled("#group-actions", "drain", !!g.draining);
    setDisabled("#group-actions", "resume", !g.draining && !faulted);
  }

  function initActions(kind) {
    const panel = $(`#${kind}-actions`);
    if (!panel) return;
    const msg = $("#action-msg");
    for (const button of $$("button[data-action]", panel)) {
      const action = button.dataset.action;
      const label = button.textContent;
      let armed = 0;
      button.addEventListener("click", async () => {
        const spec = ACTIONS[action];
        if (spec.confirm && !armed) {
          // A force release takes the GPUs from a running job: ask for a second click.
          button.textContent = spec.confirm;
          button.classList.add("armed");
          armed = setTimeout(() => {
            armed = 0;
            button.textContent = label;
            button.classList.remove("armed");
          }, 5000);
          return;
        }
        clearTimeout(armed);
        armed = 0;
        button.textContent = label;
        button.classList.remove("armed");
        const token = storedToken();
        if (!token) {
          forgetToken();
          return;
        }
        button.dataset.busy = "1";
        button.disabled = true;
        try {
          const response = await fetch(`${API}/${kind}s/${seg(pageName)}/${action}`, {
            method: "POST",
            headers: { Authorization: `Bearer ${token}` },
            cache: "no-store",
          });
          const data = await response.json().catch(() => ({}));
          if (response.ok) {
            msg.textContent = `${spec.done} ${pageName}.`;
            msg.className = "ok";
          } else {
            msg.textContent = obj(data.error).message || `The daemon answered ${response.status}.`;
            msg.className = "error";
            if (response.status === 401 || response.status === 403) forgetToken();
          }
        } catch (err) {
          msg.textContent = "The daemon could not be reached.";
          msg.className = "error";
        } finally {
          delete button.dataset.busy;
          button.disabled = false;
        }
      });
    }
  }

  // --- start ----------------------------------------------------------------------------

  function start() {
    hydrateTimes(document);
    initAdmin();
    if (!["overview", "group", "job", "timeline"].includes(page)) return;
    if (page === "group" || page === "job") initActions(page);
    if (page === "timeline") {
      const box = $("#timeline");
      live.timelineWindow = box ? Number(box.dataset.window) : 600;
      initTimeline();
    }
    live.connect();
    live.watch();
  }

  // Exposed for tests and for poking at in the browser console.
  window.timesliced = { fmtBytes, fmtDuration, fmtPct, fmtGbps, jobColor, live, timeline };

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
