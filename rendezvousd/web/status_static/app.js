// The status page: polls /api/jobs and /api/jobs/{id} (the same JSON scripts read)
// and redraws without a reload. Every value from the daemon is set as text, never
// as markup: hosts and failure causes come from clients.
"use strict";

let pollMs = 2000; // the daemon says how often (slower for very large jobs)
const HISTORY = 90; // sparkline samples
const STATES = { A: "active", H: "late heartbeat", X: "lost", J: "joining", D: "left", "-": "empty" };
const history = new Map(); // job id -> [members present, ...]
const rates = new Map(); // job id -> [steps per second, ...] once the job reports steps
let admin = false;
let timer = null;
// The finished jobs the overview asks for (the newest first): a first page, and a page
// more per "show more". The daemon holds up to max_jobs of them until their TTL; all of
// them on every poll buried the live few (400 KB at ~1,000 held).
const FINISHED_PAGE = 20;
const FINISHED_MORE = 100;
const FINISHED_MAX = 1024;
let finishedWanted = FINISHED_PAGE;
const LIVE = new Set(["FORMING", "RUNNING"]);

function $(id) { return document.getElementById(id); }

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}

function age(s) {
  if (s === null || s === undefined) return "?";
  if (s < 60) return s.toFixed(1) + " s";
  if (s < 3600) return Math.floor(s / 60) + " min " + Math.floor(s % 60) + " s";
  return Math.floor(s / 3600) + " h " + Math.floor((s % 3600) / 60) + " min";
}

function num(v) { return v === null || v === undefined ? "—" : String(v); }

// "1 used, 2 left", from the node agents' restart budgets (— where none reported).
function restarts(j) {
  if (j.restarts_used === null || j.restarts_used === undefined) return "—";
  return j.restarts_used + " used, " + j.restarts_left + " left";
}

// UTC with its "Z", as the daemon's and rendezvous-run's log lines are stamped (the
// browser's local time, unmarked, could not be lined up with logs from other hosts).
function clock(t) { return new Date(t * 1000).toISOString().replace(/\.\d{3}Z$/, "Z"); }

function selected() {
  const m = location.hash.match(/^#job=(.+)$/);
  return m ? decodeURIComponent(m[1]) : null;
}

async function getJSON(url) {
  const r = await fetch(url, { credentials: "same-origin", cache: "no-store" });
  if (r.status === 401) { location.reload(); throw new Error("logged out"); }
  if (!r.ok) throw new Error(url + ": HTTP " + r.status);
  return r.json();
}

function drawOverview(data) {
  admin = data.admin;
  pollMs = Math.max(1000, (data.poll_s || 2) * 1000);
  $("scope").textContent = data.admin ? "admin" : data.scope;
  // Which daemon answers: after an upgrade, the page says which build it reads.
  const build = data.build || {};
  $("version").textContent = data.daemon_version || "";
  $("version").title = Object.keys(build).map((k) => k + " " + build[k]).join(", ");
  const failing = data.storage_failing_since;
  $("storage").hidden = !failing;
  $("storage").textContent = failing ? "NOT_SERVING: state storage failing since " +
    clock(failing) + ": changes are refused until it takes writes again; see the daemon's log" : "";
  const live = data.jobs.filter((j) => LIVE.has(j.state));
  const done = data.jobs.filter((j) => !LIVE.has(j.state));
  drawRows($("jobs").tBodies[0], live);
  drawRows($("finished-jobs").tBodies[0], done);
  const f = data.finished || { total: 0, by_state: {} };
  $("nojobs").hidden = live.length > 0;
  $("nojobs").textContent = f.total ? "No forming or running jobs." : "No jobs.";
  $("finished").hidden = f.total === 0;
  const states = Object.keys(f.by_state).filter((s) => f.by_state[s] > 0)
    .map((s) => s.toLowerCase() + " " + f.by_state[s]).join(", ");
  $("finished-count").textContent = f.total + " finished job" + (f.total === 1 ? "" : "s") +
    " held (" + states + ")";
  $("finished-shown").textContent = done.length < f.total
    ? "the newest " + done.length + " of " + f.total + " shown" : "";
  const more = Math.min(FINISHED_MORE, f.total - done.length, FINISHED_MAX - finishedWanted);
  $("finished-more").hidden = more <= 0;
  $("finished-more").textContent = "Show " + more + " more";
}

function drawRows(body, jobs) {
  body.replaceChildren();
  for (const j of jobs) {
    const tr = el("tr");
    tr.dataset.job = j.job_id;
    const a = el("a", j.job_id);
    a.href = "#job=" + encodeURIComponent(j.job_id);
    const name = el("td"); name.append(a); tr.append(name);
    const st = el("td"); st.append(el("span", j.state, "badge " + j.state)); tr.append(st);
    tr.append(el("td", j.generation, "num"));
    tr.append(el("td", j.members_present + "/" + j.world_size, "num"));
    tr.append(el("td", j.nodes_present + "/" + j.num_nodes, "num"));
    tr.append(el("td", j.nodes_waiting, "num"));
    tr.append(el("td", age(j.state_age_s), "num"));
    tr.append(el("td", num(j.step), "num"));
    tr.append(el("td", num(j.steps_per_s), "num"));
    tr.append(el("td", restarts(j), "num"));
    tr.append(el("td", j.failures, "num"));
    tr.append(el("td", j.last_failure || "—", "cause"));
    body.append(tr);
    const h = history.get(j.job_id) || [];
    h.push(j.members_present);
    if (h.length > HISTORY) h.shift();
    history.set(j.job_id, h);
    if (j.steps_per_s !== null && j.steps_per_s !== undefined) {
      const r = rates.get(j.job_id) || [];
      r.push(j.steps_per_s);
      if (r.length > HISTORY) r.shift();
      rates.set(j.job_id, r);
    }
  }
}

// The grid's rows by node, kept between updates: a 1,024 x 8 grid is 9,000 elements,
// so an update only touches what changed (a seat's state, a heartbeat age).
let grid = { key: "", rows: new Map() };

function gridRow(r, gpus) {
  const tr = el("tr");
  const host = el("td", r.host, "host");
  // The address the node advertised (peers dial it): a multi-homed host's wrong pick.
  const address = el("td", r.address || "—", "host");
  address.title = r.address;
  const seats = el("td", null, "seats");
  // Fixed markup only (no daemon data): one parse instead of a call per seat.
  seats.innerHTML = '<span class="seat"></span>'.repeat(r.seats.length);
  const spans = Array.from(seats.children);
  seats.dataset.node = r.node;
  const ageCell = el("td", null, "num");
  const stepCell = el("td", null, "num");
  tr.append(el("td", r.node, "num"), host, address, seats, ageCell, stepCell);
  return {
    tr, host, address, spans, ageCell, stepCell, node: r.node, gpus, seats: "", age: "", step: "",
    hostText: r.host, addressText: r.address,
  };
}

function updateRow(g, r) {
  if (g.hostText !== r.host) { g.host.textContent = r.host; g.hostText = r.host; }
  if (g.addressText !== r.address) {
    g.address.textContent = r.address || "—";
    g.address.title = r.address;
    g.addressText = r.address;
  }
  if (g.seats !== r.seats) {
    for (let i = 0; i < g.spans.length; i++) {
      const c = r.seats[i] || "-";
      if (g.seats[i] !== c) g.spans[i].className = "seat " + c;
    }
    g.seats = r.seats;
  }
  const a = r.age === null ? "—" : age(r.age);
  if (g.age !== a) { g.ageCell.textContent = a; g.age = a; }
  const s = num(r.step);
  if (g.step !== s) { g.stepCell.textContent = s; g.step = s; }
}

function drawGrid(jobId, rows, total, gpus) {
  const key = jobId + "/" + gpus + "/" + rows.map(r => r.node).join(",");
  if (grid.key !== key) {
    // Another job, or nodes came or went: built afresh.
    grid = { key, rows: new Map() };
    const frag = document.createDocumentFragment();
    for (const r of rows) {
      const g = gridRow(r, gpus);
      grid.rows.set(r.node, g);
      frag.append(g.tr);
    }
    $("grid").tBodies[0].replaceChildren(frag);
  }
  for (const r of rows) updateRow(grid.rows.get(r.node), r);
  $("grid-more").textContent = rows.length < total ? rows.length + " of " + total + " nodes shown" : "";
}

function drawSpark(job) {
  // The step rate once the job reports steps; until then, who is present.
  const r = rates.get(job.job_id);
  const byRate = r !== undefined && r.length > 0;
  const h = byRate ? r : history.get(job.job_id) || [];
  $("spark-title").textContent = byRate ? "Steps per second" : "Members present";
  const max = Math.max(1, ...h, byRate ? 0 : job.world_size);
  const step = h.length > 1 ? 240 / (h.length - 1) : 240;
  const pts = h.map((v, i) => (i * step).toFixed(1) + "," + (46 - (v / max) * 40).toFixed(1));
  if (pts.length === 1) pts.push("240," + pts[0].split(",")[1]);
  $("spark").querySelector("polyline").setAttribute("points", pts.join(" "));
  const right = pts[pts.length - 1].split(",")[0];
  $("spark").querySelector("polygon").setAttribute("points", "0,48 " + pts.join(" ") + " " + right + ",48");
  const samples = h.length + (h.length === 1 ? " sample" : " samples");
  $("spark-note").textContent = byRate
    ? samples + ", now " + job.steps_per_s + " steps/s at step " + num(job.step)
    : samples + ", now " + job.members_present + " of " + job.world_size;
}

function drawJob(job, rows) {
  $("job").hidden = false;
  $("job-title").textContent = job.job_id;
  const st = $("job-state");
  st.textContent = job.state;
  st.className = "badge " + job.state;
  $("job-facts").textContent =
    "generation " + job.generation + " · " + job.members_present + "/" + job.world_size +
    " members · " + job.num_nodes + " × " + job.gpus_per_node + " · in state " + age(job.state_age_s) +
    (job.step !== null && job.step !== undefined ? " · step " + job.step : "") +
    (job.restarts_used !== null && job.restarts_used !== undefined ? " · restarts " + restarts(job) : "") +
    (job.abort_reason ? " · " + job.abort_reason : "");
  $("abort").hidden = !admin || !(job.state === "RUNNING" || job.state === "FORMING");
  drawGrid(job.job_id, rows, job.nodes.total, job.gpus_per_node);
  drawSpark(job);
  $("waiting").textContent = job.nodes_waiting;
  $("standbys").hidden = !job.standbys;
  $("standbys").textContent = job.standbys + " of them standing by for a lost node's slot";
  $("kept").hidden = !job.seats_kept;
  $("kept").textContent = job.seats_kept + " seat(s) kept for nodes re-joining after the failure (" +
    Math.round(job.seats_kept_s) + " s more)";
  // A join after every member left opens a new run: a late node of the run that ended
  // (a pod restarted after success) waits here for nodes that are done.
  const ended = job.previous_run_ended_s;
  $("rerun").hidden = ended === null || ended === undefined;
  $("rerun").textContent = "a new run of this job id: its previous run ended " + age(ended) +
    " ago (every member left)";
  drawForming(job.forming);
  // A joiner that contradicted the forming generation (topology, version): no member
  // was lost, so the list below is empty and this is the whole story.
  $("conflict-box").hidden = !job.conflict;
  $("conflict").textContent = job.conflict || "";
  const failed = $("failed");
  failed.replaceChildren();
  for (const f of job.failed) {
    const li = el("li");
    li.append(el("strong", "rank " + f.rank));
    li.append(el("span", " on " + f.host + " (node " + f.node_rank + ", local rank " + f.local_rank + ")"));
    if (f.age_s !== null) li.append(el("span", " " + age(f.age_s) + " ago", "muted"));
    li.append(el("div", f.cause, "cause"));
    failed.append(li);
  }
  $("nofailed").hidden = job.failed.length > 0;
  const tl = $("timeline");
  tl.replaceChildren();
  for (const e of job.timeline.slice().reverse()) {
    const li = el("li", null, "t-" + e.to);
    li.append(el("span", clock(e.at), "muted"));
    li.append(el("span", " gen " + e.generation + " "));
    li.append(el("span", e.to, "badge " + e.to));
    if (e.change) li.append(el("span", " " + e.change, "change"));
    li.append(el("div", e.detail, "cause"));
    tl.append(li);
  }
}

// A forming node generation: who joined (node rank if it named one, host, instance,
// when) and what it still lacks, so a missing node is named, not only counted.
function drawForming(f) {
  $("forming").hidden = !f;
  if (!f) return;
  // A per-rank job's joining ranks are its grid's rows: only what is missing here.
  $("joined-head").hidden = !f.min_nodes;
  const list = $("joined");
  list.replaceChildren();
  for (const n of f.joined) {
    const li = el("li");
    li.append(el("strong", n.node === null ? "a node" : "node " + n.node));
    li.append(el("span", " on " + n.host));
    li.append(el("span", " joined " + age(n.joined_s) + " ago", "muted"));
    li.append(el("div", "instance " + n.instance_tag, "muted"));
    list.append(li);
  }
  const more = f.joined_total - f.joined.length;
  $("joined-more").hidden = more <= 0;
  $("joined-more").textContent = "and " + more + " more";
  $("missing").hidden = !f.missing;
  $("missing").textContent = "missing: " + f.missing;
}

async function refresh() {
  try {
    // Marks (first update only) for benchmarks/status_page.py's breakdown.
    performance.mark("rdzv-start");
    const data = await getJSON("/api/jobs?finished_limit=" + finishedWanted);
    performance.mark("rdzv-overview");
    // A lone job held opens by itself, live or finished.
    const held = data.jobs.filter((j) => LIVE.has(j.state)).length +
    (data.finished ? data.finished.total : 0);
    const id = selected() || (held === 1 && data.jobs.length === 1 ? data.jobs[0].job_id : null);
    let job = null;
    let rows = [];
    if (id !== null) {
      const url = "/api/jobs/" + encodeURIComponent(id);
      job = await getJSON(url);
      rows = job.nodes.rows;
      // Past one page (1,024 nodes) the grid asks for the rest, a page at a time.
      for (let off = job.nodes.offset + job.nodes.limit; off < job.nodes.total; off += job.nodes.limit) {
        const more = await getJSON(url + "?node_offset=" + off + "&node_limit=" + job.nodes.limit);
        rows = rows.concat(more.nodes.rows);
      }
      performance.mark("rdzv-job");
      // The shown job's row is drawn from the panel's own, later answer (a superset of
      // the row's): drawn from the overview's, it could lag the panel by one update,
      // RUNNING gen 1 in the table beside FORMING gen 2 in the panel.
      const at = data.jobs.findIndex((j) => j.job_id === job.job_id);
      if (at >= 0) data.jobs[at] = job;
    }
    drawOverview(data);
    if (job === null) {
      $("job").hidden = true;
    } else {
      drawJob(job, rows);
      performance.mark("rdzv-drawn");
    }
    $("updated").textContent = "updated " + clock(Date.now() / 1000);
    $("updated").classList.remove("stale");
  } catch (err) {
    $("updated").textContent = "not updated: " + err.message;
    $("updated").classList.add("stale");
  }
  document.body.dataset.ready = "1";
}

async function abortJob() {
  const id = $("job-title").textContent;
  if (!confirm("Abort job " + id + "? Every worker is told to stop.")) return;
  const r = await fetch("/api/jobs/" + encodeURIComponent(id) + "/abort", {
    method: "POST",
    credentials: "same-origin",
    headers: { "Content-Type": "application/json", "X-Requested-With": "rendezvousd" },
    body: JSON.stringify({ reason: "" }),
  });
  const body = await r.json().catch(() => ({}));
  if (!r.ok) alert("Abort failed: " + (body.error || r.status));
  refresh();
}

function loop() {
  clearTimeout(timer);
  refresh().finally(() => { timer = setTimeout(loop, pollMs); });
}

// A seat's tooltip is made when hovered: 8,192 titles kept up to date would cost
// every update.
function seatTitle(ev) {
  const s = ev.target;
  if (!s.classList || !s.classList.contains("seat") || !s.parentNode.dataset.node) return;
  const node = Number(s.parentNode.dataset.node);
  const i = Array.prototype.indexOf.call(s.parentNode.children, s);
  const gpus = s.parentNode.children.length;
  s.title = "node " + node + " local rank " + i + " (rank " + (node * gpus + i) + "): " +
    STATES[s.className.slice(5)];
}

document.addEventListener("DOMContentLoaded", () => {
  $("abort").addEventListener("click", abortJob);
  $("finished-more").addEventListener("click", () => {
    finishedWanted = Math.min(FINISHED_MAX, finishedWanted + FINISHED_MORE);
    loop();
  });
  $("grid").addEventListener("mouseover", seatTitle);
  window.addEventListener("hashchange", loop);
  loop();
});
