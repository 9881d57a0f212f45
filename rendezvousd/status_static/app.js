// The status page: polls /api/jobs and /api/jobs/{id} (the same JSON scripts read)
// and redraws without a reload. Every value from the daemon is set as text, never
// as markup: hosts and failure causes come from clients.
"use strict";

const POLL_MS = 2000;
const HISTORY = 90; // sparkline samples: three minutes at POLL_MS
const STATES = { A: "active", H: "late heartbeat", X: "lost", J: "joining", D: "left", "-": "empty" };
const history = new Map(); // job id -> [members present, ...]
let admin = false;
let timer = null;

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

function clock(t) { return new Date(t * 1000).toLocaleTimeString(); }

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
  $("scope").textContent = data.admin ? "admin" : data.scope;
  const body = $("jobs").tBodies[0];
  body.replaceChildren();
  for (const j of data.jobs) {
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
    tr.append(el("td", j.failures, "num"));
    tr.append(el("td", j.last_failure || "—", "cause"));
    body.append(tr);
    const h = history.get(j.job_id) || [];
    h.push(j.members_present);
    if (h.length > HISTORY) h.shift();
    history.set(j.job_id, h);
  }
  $("nojobs").hidden = data.jobs.length > 0;
}

function drawGrid(rows, total, gpus) {
  const body = $("grid").tBodies[0];
  const frag = document.createDocumentFragment();
  for (const r of rows) {
    const tr = el("tr");
    tr.append(el("td", r.node, "num"));
    tr.append(el("td", r.host, "host"));
    const seats = el("td", null, "seats");
    for (let i = 0; i < r.seats.length; i++) {
      const c = r.seats[i];
      const s = el("span", null, "seat " + c);
      s.title = "node " + r.node + " local rank " + i + " (rank " + (r.node * gpus + i) + "): " + STATES[c];
      seats.append(s);
    }
    tr.append(seats);
    tr.append(el("td", age(r.age), "num"));
    frag.append(tr);
  }
  body.replaceChildren(frag);
  $("grid-more").textContent = rows.length < total ? rows.length + " of " + total + " nodes shown" : "";
}

function drawSpark(job) {
  const h = history.get(job.job_id) || [];
  const max = Math.max(1, job.world_size, ...h);
  const step = h.length > 1 ? 240 / (h.length - 1) : 240;
  const pts = h.map((v, i) => (i * step).toFixed(1) + "," + (46 - (v / max) * 44).toFixed(1));
  $("spark").querySelector("polyline").setAttribute("points", pts.join(" "));
  $("spark-note").textContent = h.length + " samples, now " + job.members_present + " of " + job.world_size;
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
    (job.abort_reason ? " · " + job.abort_reason : "");
  $("abort").hidden = !admin || !(job.state === "RUNNING" || job.state === "FORMING");
  drawGrid(rows, job.nodes.total, job.gpus_per_node);
  drawSpark(job);
  $("waiting").textContent = job.nodes_waiting;
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
    li.append(el("div", e.detail, "cause"));
    tl.append(li);
  }
}

async function refresh() {
  try {
    const data = await getJSON("/api/jobs");
    drawOverview(data);
    const id = selected() || (data.jobs.length === 1 ? data.jobs[0].job_id : null);
    if (id === null) {
      $("job").hidden = true;
    } else {
      const url = "/api/jobs/" + encodeURIComponent(id);
      const job = await getJSON(url);
      let rows = job.nodes.rows;
      // Past one page (1,024 nodes) the grid asks for the rest, a page at a time.
      for (let off = job.nodes.offset + job.nodes.limit; off < job.nodes.total; off += job.nodes.limit) {
        const more = await getJSON(url + "?node_offset=" + off + "&node_limit=" + job.nodes.limit);
        rows = rows.concat(more.nodes.rows);
      }
      drawJob(job, rows);
    }
    $("updated").textContent = "updated " + new Date().toLocaleTimeString();
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
  refresh().finally(() => { timer = setTimeout(loop, POLL_MS); });
}

document.addEventListener("DOMContentLoaded", () => {
  $("abort").addEventListener("click", abortJob);
  window.addEventListener("hashchange", loop);
  loop();
});
