// The dashboard: one page, no framework. Its requests carry the session cookie that its login
// set (Note [Tokens out of URLs], src/queue/access.h); it polls the REST API every second, and
// draws the jobs, each host's workers over time and the decisions with their reasons. See
// docs/queue.md, "Dashboard".
//
// The timeline is drawn from the workers' own start and end times (GET /jobs/ID), not from what
// the page happened to see while it was open: a page opened after a shrink still shows the
// workers that left, and every reload shows the same picture. Each host has one lane per slot;
// a worker keeps the lane it started in, and a lane is reused once its worker has ended. The
// decisions of the policy are marked on the timeline where they were taken.
//
// Stable ids for tests and scripts (tests/queue_dashboard_test.cpp): a row `job-ID` per job (its
// cells have the classes name, state, throughput, ...), a group of class `outage` per scheduler
// outage on each host's timeline, a section `host-NAME` per host with its lanes
// (`slot N` labels) and a bar `worker-ID` per worker, a row `event-ID` per event (class
// `kind-KIND`, `decision` for the policy's own, `chatter` for a single worker's, hidden unless
// asked for), and <body data-polls="N"> once N polls have been drawn.
#include "server.h"

namespace shoal::queue {

const char* dashboard_html() {
  return R"HTML(<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>shoal queue</title>
<style>
body { font: 14px/1.4 sans-serif; margin: 16px 24px; color: #222; }
h1 { font-size: 20px; margin: 0 0 2px; } h2 { font-size: 16px; margin: 16px 0 6px; }
h3 { font-size: 14px; margin: 8px 0 2px; font-weight: normal; } h3 b { font-weight: bold; }
#summary { color: #555; } #error { color: #b00; font-weight: bold; }
table { border-collapse: collapse; }
td, th { padding: 3px 14px 3px 0; text-align: left; vertical-align: top; }
th { border-bottom: 1px solid #999; font-weight: 600; } tbody tr { border-bottom: 1px solid #eee; }
td.id, td.priority, td.workers, td.range, td.throughput, td.resizes { text-align: right; }
.state-running, .state-waiting, .state-failed { font-weight: 600; }
.state-running { color: #16794c; } .state-waiting { color: #a66b00; } .state-failed { color: #b00; }
.state-done, .state-cancelled { color: #666; }
.swatch { width: 12px; height: 12px; display: inline-block; vertical-align: -1px; margin-right: 6px;
          border-radius: 2px; }
td { font-variant-numeric: tabular-nums; }
svg text { font: 11px sans-serif; font-variant-numeric: tabular-nums; }
svg .axis { fill: #666; } svg .lane-label { fill: #333; }
svg .bar-label { fill: #fff; font-weight: bold; } svg .marker-label { fill: #444; }
#events.quiet tr.chatter { display: none; } h2 label { font-size: 13px; font-weight: normal; }
#events td { font-size: 13px; } #events td.time { color: #555; white-space: nowrap; }
#events tr.decision td.kind { font-weight: bold; } #events tr:not(.decision) td { color: #777; }
</style></head><body>
<h1>shoal queue</h1><div id="summary">connecting...</div><div id="error"></div>
<h2>Jobs</h2>
<table id="jobs"><thead><tr><th>job</th><th>name</th><th>state</th><th>priority</th>
<th>workers</th><th>min-max</th><th>throughput</th><th>resizes</th><th>reason</th></tr></thead>
<tbody></tbody></table>
<h2>Workers per host over time</h2><div id="hosts"></div>
<h2>Decisions
<label><input type="checkbox" id="show-chatter"> with each worker's start and end</label></h2>
<table id="events" class="quiet">
<thead><tr><th>time</th><th>job</th><th>kind</th><th>what and why</th></tr></thead>
<tbody></tbody></table>
<script>
// Dark enough for the white labels on the bars.
const colours = ['#4e79a7', '#e8762b', '#c8434a', '#3f9a94', '#4c9443', '#b8961c', '#9b659a',
                 '#d9707e', '#8a6249', '#7f7f7f'];
const colour = job => colours[(job - 1) % colours.length];
// The policy's own decisions; the other events (a job submitted or ended) are facts, and those
// of single workers (started, left, ended) are hidden unless asked for: the bars show them.
const decisions =
    new Set(['start', 'grow', 'shrink', 'preempt', 'replace', 'restart', 'wait', 'requeue']);
const chatter = new Set(['worker', 'left', 'ended']);
const marked = new Set(['start', 'grow', 'shrink', 'preempt', 'replace', 'restart']);
const svgNS = 'http://www.w3.org/2000/svg';
const events = [];  // the last events seen, oldest first, for the timeline's marks
let since = 0;

async function api(path) {
  const response = await fetch(path, {credentials: 'same-origin'});
  if (response.status === 401) location.assign('/login');  // the session ended
  const body = await response.json();
  if (!response.ok) throw new Error(body.error || response.statusText);
  return body;
}
function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined) e.textContent = text;
  if (cls) e.className = cls;
  return e;
}
function svg(tag, attrs, text) {
  const e = document.createElementNS(svgNS, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}
const clock = ms => new Date(ms).toLocaleTimeString('en-GB');
const jobName = j => j.name || j.argv[0].split('/').pop();

function drawJobs(jobs) {
  const body = document.querySelector('#jobs tbody');
  body.replaceChildren();
  for (const j of jobs) {
    const row = el('tr');
    row.id = 'job-' + j.id;
    row.dataset.state = j.state;
    const name = el('td', undefined, 'name');
    const swatch = el('span', undefined, 'swatch');
    swatch.style.background = colour(j.id);
    name.append(swatch, jobName(j));
    row.append(el('td', j.id, 'id'), name, el('td', j.state, 'state state-' + j.state),
               el('td', j.priority, 'priority'), el('td', j.workers, 'workers'),
               el('td', j.min + '-' + j.max, 'range'), throughputCell(j.throughput, j.goodput),
               el('td', j.resizes, 'resizes'), el('td', j.reason, 'reason'));
    body.appendChild(row);
  }
}

// The job's measured samples per second beside the worker count they were measured at (docs/
// queue.md, "Throughput"), with every count's last measurement and the speed-up the goodput
// policy models from them (and from the gradient noise scale) in its title.
function throughputCell(t, g) {
  const cell = el('td', '-', 'throughput');
  if (!t) return cell;
  if (t.samples_per_s !== null) {
    cell.textContent = Math.round(t.samples_per_s) + ' samples/s at ' + t.world +
                       (t.world === 1 ? ' worker' : ' workers');
  }
  const lines = [];
  const each = Object.entries(t.by_world).map(([w, r]) => w + ': ' + Math.round(r));
  if (each.length) lines.push('samples/s by workers, ' + each.join(', '));
  if (g && g.speedup.length) {
    lines.push('modeled speed-up by workers, ' + g.speedup.map((s, i) => (i + 1) + ': ' + s.toFixed(2)).join(', ') +
               (g.noise_scale > 0 ? ' (gradient noise scale ' + Math.round(g.noise_scale) + ' samples)' : ''));
  }
  if (lines.length) cell.title = lines.join('\n');
  return cell;
}

// A tick step of about a tenth of the span, from a list of round durations.
function tickStep(span) {
  const steps = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800].map(s => s * 1000);
  return steps.find(s => span / s <= 10) || steps[steps.length - 1];
}

// How long a worker asked to leave may still run beside the one that took its slot.
const handover = 15e3;

// When a worker took its slot: when it started; one that ended before it started (its host was
// lost first) held none, and is drawn where it ended; one still starting holds its slot from now.
function startOf(w, now) {
  return w.started_ms || (w.state === 'exited' && w.ended_ms) || now;
}

function drawHosts(nodes, workers, names, now, outages) {
  const box = document.getElementById('hosts');
  box.replaceChildren();
  // The window: from the oldest worker shown, at least 30 seconds and at most 30 minutes.
  const oldest = Math.min(...workers.map(w => startOf(w, now)), now);
  const from = Math.max(now - 30 * 60e3, Math.min(now - 30e3, oldest - 2e3));
  const left = 64, right = 12, top = 30, lane = 22, axis = 20;
  const width = Math.max(600, box.clientWidth || 1000);
  const x = t => left + (width - left - right) * (Math.max(t, from) - from) / (now - from);
  for (const n of nodes) {
    const mine = workers.filter(w => w.host === n.name && (!w.ended_ms || w.ended_ms >= from))
        .sort((a, b) => startOf(a, now) - startOf(b, now) || a.id - b.id);
    const freeAt = [];    // per lane, when its last worker ended (Infinity while it runs)
    const occupant = [];  // per lane, its last worker
    const laneOf = new Map();
    for (const w of mine) {
      const start = startOf(w, now), end = w.state === 'exited' ? w.ended_ms : Infinity;
      let k = freeAt.findIndex(t => t <= start);
      // A worker that started on the slot of one asked to leave, while that one finished its
      // step (Note [Starting on leaving slots] in src/queue/policy.cpp), takes over its lane.
      if (k < 0) {
        k = occupant.findIndex((o, i) => (o.leave || o.stop) &&
                               (o.state !== 'exited' || freeAt[i] <= start + handover));
      }
      if (k < 0) k = freeAt.push(end) - 1; else freeAt[k] = end;
      occupant[k] = w;
      laneOf.set(w.id, k);
    }
    const lanes = Math.max(n.capacity, freeAt.length, 1);
    const height = top + lanes * lane + axis;
    const section = el('div', undefined, 'host');
    section.id = 'host-' + n.name;
    const title = el('h3');
    title.append(el('b', n.name), (n.alive ? '' : ' (lost)') + ': ' + n.workers.length + ' of ' +
                 n.capacity + ' slots used, ' + n.cores + ' cores');
    section.appendChild(title);
    const chart = svg('svg', {width: width, height: height, class: 'timeline'});
    chart.appendChild(svg('rect', {x: left, y: top, width: width - left - right,
                                   height: lanes * lane, fill: '#f5f5f5'}));
    for (let k = 0; k < lanes; ++k) {
      const y = top + k * lane;
      chart.appendChild(svg('text', {x: 4, y: y + 15, class: 'lane-label'},
                            'slot ' + (k + 1) + (k >= n.capacity ? ' (over)' : '')));
      if (k > 0) {
        chart.appendChild(svg('line', {x1: left, x2: width - right, y1: y, y2: y, stroke: '#fff'}));
      }
    }
    // Note [Outages] in src/queue/scheduler_storage.cpp: no scheduler ran here, so no decision was taken.
    for (const o of outages) {
      if (o.to_ms < from) continue;
      const g = svg('g', {class: 'outage', 'data-from': o.from_ms, 'data-to': o.to_ms});
      g.appendChild(svg('rect', {x: x(o.from_ms), y: top, height: lanes * lane,
                                 width: Math.max(x(o.to_ms) - x(o.from_ms), 2),
                                 fill: '#555', 'fill-opacity': 0.25}));
      g.appendChild(svg('text', {x: x(o.from_ms) + 3, y: top + lanes * lane - 4,
                                 class: 'marker-label'}, 'no scheduler'));
      g.appendChild(svg('title', {}, 'no scheduler ran from ' + clock(o.from_ms) + ' to ' +
                                     clock(o.to_ms)));
      chart.appendChild(g);
    }
    const step = tickStep(now - from);
    for (let t = Math.ceil(from / step) * step; t <= now; t += step) {
      chart.appendChild(svg('line', {x1: x(t), x2: x(t), y1: top, y2: top + lanes * lane + 3,
                                     stroke: '#ddd'}));
      chart.appendChild(svg('text', {x: x(t), y: height - 4, 'text-anchor': 'middle',
                                     class: 'axis'}, clock(t)));
    }
    for (const w of mine) {
      const start = startOf(w, now), end = w.state === 'exited' ? w.ended_ms : now;
      const x0 = x(start), x1 = Math.max(x(end), x0 + 2), y = top + laneOf.get(w.id) * lane + 2;
      const g = svg('g', {id: 'worker-' + w.id, class: 'worker', 'data-job': w.job,
                          'data-slot': laneOf.get(w.id) + 1, 'data-state': w.state});
      const leaving = w.state !== 'exited' && (w.leave || w.stop);
      g.appendChild(svg('rect', {x: x0, y: y, width: x1 - x0, height: lane - 4, rx: 2,
                                 fill: colour(w.job), 'fill-opacity': leaving ? 0.45 : 1}));
      const span = !w.started_ms ? (w.state === 'exited' ? 'never started, ' + w.exit : 'starting')
          : 'pid ' + w.pid + ': ' + clock(start) + ' to ' +
            (w.state === 'exited' ? clock(end) + ', ' + w.exit : 'now');
      g.appendChild(svg('title', {}, 'worker ' + w.id + ' of job ' + w.job + ' (' + names[w.job] +
                        '), ' + span + (leaving ? ', asked to leave' : '')));
      const label = names[w.job] + ' w' + w.id;
      if (x1 - x0 > 7 * label.length + 8) {
        g.appendChild(svg('text', {x: x0 + 5, y: y + 13, class: 'bar-label'}, label));
      }
      chart.appendChild(g);
    }
    // Where the policy decided, so that a change of the bars can be read against its reason.
    let row = 0;
    for (const e of events) {
      if (!marked.has(e.kind) || e.time_ms < from) continue;
      const at = x(e.time_ms);
      chart.appendChild(svg('line', {x1: at, x2: at, y1: top - 12 + (row % 2) * 10,
                                     y2: top + lanes * lane, stroke: '#333',
                                     'stroke-dasharray': '3,3'}));
      chart.appendChild(svg('text', {x: at + 3, y: top - 15 + (row % 2) * 10,
                                     class: 'marker-label'},
                            e.kind + ' ' + (names[e.job] || 'job ' + e.job)));
      ++row;
    }
    chart.appendChild(svg('line', {x1: x(now), x2: x(now), y1: top, y2: top + lanes * lane,
                                   stroke: '#b00'}));
    section.appendChild(chart);
    box.appendChild(section);
  }
}

function addEvents(list, names) {
  const body = document.querySelector('#events tbody');
  for (const e of list) {
    since = Math.max(since, e.id);
    events.push(e);
    if (events.length > 5000) events.shift();
    const row = el('tr');
    row.id = 'event-' + e.id;
    row.className = 'kind-' + e.kind + (decisions.has(e.kind) ? ' decision' : '') +
                    (chatter.has(e.kind) ? ' chatter' : '');
    row.append(el('td', clock(e.time_ms), 'time'),
               el('td', e.job ? e.job + ' ' + (names[e.job] || '') : '', 'job'),
               el('td', e.kind, 'kind'), el('td', e.message, 'message'));
    body.insertBefore(row, body.firstChild);
  }
  while (body.children.length > 500) body.removeChild(body.lastChild);
}

async function poll() {
  try {
    const [jobs, nodes, fresh, metrics] = await Promise.all(
        [api('/jobs'), api('/nodes'), api('/events?since=' + since), api('/metrics')]);
    const now = Date.now();
    const names = {};
    for (const j of jobs.jobs) names[j.id] = jobName(j);
    // The workers of the jobs that may show in the window: one request per job that runs or
    // ended in the last 30 minutes.
    const recent = jobs.jobs.filter(j => !j.ended_ms || j.ended_ms >= now - 30 * 60e3);
    const details = await Promise.all(recent.map(j => api('/jobs/' + j.id)));
    const workers = details.flatMap(j => j.worker_list);
    drawJobs(jobs.jobs);
    addEvents(fresh.events, names);
    drawHosts(nodes.nodes, workers, names, now, metrics.outages || []);
    document.getElementById('summary').textContent = metrics.workers + ' of ' + metrics.capacity +
        ' slots used; ' + metrics.resizes + ' resizes, ' + metrics.preemptions + ' preemptions, ' +
        metrics.preemption_cycles + ' preemption cycles, ' + metrics.failures +
        ' failures; updated ' + clock(now);
    document.getElementById('error').textContent = '';
    document.body.dataset.polls = (+(document.body.dataset.polls || 0) + 1);
  } catch (err) {
    document.getElementById('error').textContent = 'cannot read the queue: ' + err.message;
  }
}
// One poll at a time: a slow answer delays the next instead of piling requests up.
async function loop() {
  await poll();
  setTimeout(loop, 1000);
}
document.getElementById('show-chatter').addEventListener('change', event =>
    document.getElementById('events').classList.toggle('quiet', !event.target.checked));
loop();
</script></body></html>
)HTML";
}

}  // namespace shoal::queue
