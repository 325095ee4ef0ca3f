// The dashboard page: polls the server's JSON API (answered from its cache: no DHT reads) and
// draws the member table and the run's curves with uPlot (shipped with the package: no internet).
// Every string a peer published goes in with textContent, never as HTML: any peer may lie.
"use strict";
(function () {
  const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2"];
  const MAX_SERIES = COLORS.length; // evaluating peers drawn; the table below lists every result
  const STATUS_TEXT = { live: "live", quiet: "quiet", left: "left", expired: "gone" };
  const charts = {};
  let refreshMs = 2000;

  const byId = (id) => document.getElementById(id);
  const setText = (id, value) => { byId(id).textContent = value; };
  const isNumber = (value) => typeof value === "number" && isFinite(value);
  const fixed = (value, digits) => (isNumber(value) ? value.toFixed(digits) : "-");
  const megabytes = (value) => (isNumber(value) ? (value / 1e6).toFixed(1) : "-");
  const percent = (value) => (isNumber(value) ? (100 * value).toFixed(2) + "%" : "-");

  function ago(seconds) {
    if (!isNumber(seconds)) return "-";
    if (seconds < 90) return Math.round(seconds) + " s ago";
    if (seconds < 5400) return Math.round(seconds / 60) + " min ago";
    return Math.round(seconds / 3600) + " h ago";
  }

  function clock(unixSeconds) {
    return new Date(unixSeconds * 1000).toLocaleTimeString([], { hour12: false });
  }

  function addCell(row, value, className) {
    const cell = document.createElement("td");
    cell.textContent = value;
    if (className) cell.className = className;
    row.appendChild(cell);
    return cell;
  }

  async function getJSON(path) {
    const response = await fetch(path, { cache: "no-store" });
    if (!response.ok) throw new Error(path + ": HTTP " + response.status);
    return response.json();
  }

  // ---- summary, message and members -------------------------------------------------------------

  function renderRun(run) {
    setText("run-id", run.run_id);
    document.title = "swarmgrad · " + run.run_id;
    const message = byId("message");
    message.hidden = !run.message;
    message.textContent = run.message || "";
    const summary = run.summary;
    setText("sum-members", String(summary.members));
    setText("sum-training", String(summary.training));
    setText("sum-speed", fixed(summary.samples_per_second, 0));
    setText("sum-epoch", fixed(summary.epoch, 0));
    setText("sum-loss", fixed(summary.loss, 4));
    setText("sum-rounds", summary.rounds_ok + " / " + summary.rounds_failed);
    setText("sum-reads", fixed(run.dht.reads_per_second, 2));
    const evaluation = summary.evaluation;
    setText("sum-accuracy", evaluation ? percent(evaluation.accuracy) : "-");
    setText("sum-accuracy-by", evaluation ? "by " + evaluation.short_id + ", " + ago(run.now - evaluation.t) : "");
    renderMembers(run.members);
  }

  function renderMembers(members) {
    const body = byId("members-body");
    const rows = members.map((member) => {
      const row = document.createElement("tr");
      row.className = "member " + member.status;
      row.dataset.peerId = member.peer_id;
      addCell(row, member.short_id).title = member.peer_id + "\n" + member.maddrs.join("\n");
      addCell(row, STATUS_TEXT[member.status] || member.status, "state");
      addCell(row, member.role);
      addCell(row, member.reachability);
      addCell(row, member.version);
      addCell(row, String(member.step), "num");
      addCell(row, member.epoch === null ? "-" : String(member.epoch), "num");
      addCell(row, fixed(member.samples_per_second, 0), "num");
      addCell(row, fixed(member.loss, 4), "num");
      addCell(row, megabytes(member.bytes_sent), "num");
      addCell(row, megabytes(member.bytes_received), "num");
      addCell(row, member.rounds_ok === null ? "-" : member.rounds_ok + "/" + member.rounds_failed, "num");
      addCell(row, fixed(member.epsilon, 2), "num");
      addCell(row, ago(member.age), "num");
      return row;
    });
    if (!rows.length) {
      const row = document.createElement("tr");
      addCell(row, "no members yet", "empty").colSpan = 14;
      rows.push(row);
    }
    body.replaceChildren(...rows);
  }

  // ---- charts -----------------------------------------------------------------------------------

  function countPoints(data) {
    let points = 0;
    for (let i = 1; i < data.length; i++) points += data[i].filter(isNumber).length;
    return points;
  }

  // one uPlot per box, rebuilt when its series change, otherwise fed new data
  function draw(id, labels, data, options) {
    const box = byId(id);
    const points = countPoints(data);
    box.dataset.points = String(points);
    box.dataset.series = String(labels.length);
    const key = labels.join("|");
    let chart = charts[id];
    if (chart && chart.key !== key) {
      chart.plot.destroy();
      chart = charts[id] = undefined;
    }
    if (!points) {
      if (!box.querySelector(".nodata")) {
        box.replaceChildren();
        const note = document.createElement("div");
        note.className = "nodata";
        note.textContent = "no data yet";
        box.appendChild(note);
      }
      return;
    }
    if (!chart) {
      box.replaceChildren();
      const series = [{}].concat(labels.map((label, i) => ({
        label: label, stroke: COLORS[i % COLORS.length], width: 2, spanGaps: true,
        points: { show: Boolean(options && options.points), size: 6 },
      })));
      const plot = new uPlot({
        width: Math.max(240, box.clientWidth), height: 200, series: series,
        scales: { x: { time: true }, y: options && options.range ? { range: options.range } : {} },
        axes: [{}, { size: 56 }], legend: { live: false },
      }, data, box);
      chart = charts[id] = { key: key, plot: plot };
    } else {
      chart.plot.setData(data);
    }
  }

  function byEvaluator(evaluators, field) {
    const shown = evaluators.slice(0, MAX_SERIES);
    const times = Array.from(new Set(shown.flatMap((e) => e.results.map((r) => r.t)))).sort((a, b) => a - b);
    const index = new Map(times.map((t, i) => [t, i]));
    const columns = shown.map((evaluator) => {
      const column = new Array(times.length).fill(null);
      evaluator.results.forEach((result) => {
        if (isNumber(result[field])) column[index.get(result.t)] = result[field];
      });
      return column;
    });
    return { labels: shown.map((e) => e.short_id), data: [times].concat(columns) };
  }

  function accuracyRange(u, min, max) {
    return [Math.max(0, Math.floor((min - 0.02) * 50) / 50), Math.min(1, Math.ceil((max + 0.01) * 50) / 50)];
  }

  function renderEvaluations(evaluators) {
    const accuracy = byEvaluator(evaluators, "accuracy");
    draw("chart-accuracy", accuracy.labels, accuracy.data, { range: accuracyRange, points: true });
    const loss = byEvaluator(evaluators, "loss");
    draw("chart-eval-loss", loss.labels, loss.data, { points: true });
    const latest = evaluators.flatMap((e) => e.results.map((r) => ({ evaluator: e, result: r })))
      .sort((a, b) => b.result.t - a.result.t).slice(0, 12);
    const rows = latest.map(({ evaluator, result }) => {
      const row = document.createElement("tr");
      row.className = "evaluation";
      row.dataset.peerId = evaluator.peer_id;
      addCell(row, clock(result.t));
      addCell(row, evaluator.short_id).title = evaluator.peer_id;
      addCell(row, evaluator.task || "-");
      addCell(row, String(result.epoch), "num");
      addCell(row, String(result.step), "num");
      addCell(row, percent(result.accuracy), "num");
      addCell(row, fixed(result.loss, 4), "num");
      return row;
    });
    if (!rows.length) {
      const row = document.createElement("tr");
      addCell(row, "no evaluation published yet", "empty").colSpan = 7;
      rows.push(row);
    }
    byId("evaluations-body").replaceChildren(...rows);
  }

  function renderHistory(history) {
    const t = history.t;
    draw("chart-loss", ["median loss"], [t, history.loss]);
    draw("chart-speed", ["samples/s"], [t, history.samples_per_second]);
    draw("chart-rounds", ["ok", "failed"], [t, history.rounds_ok, history.rounds_failed]);
    draw("chart-members", ["present", "training"], [t, history.members, history.training]);
  }

  window.addEventListener("resize", () => {
    Object.keys(charts).forEach((id) => {
      const chart = charts[id];
      if (chart) chart.plot.setSize({ width: Math.max(240, byId(id).clientWidth), height: 200 });
    });
  });

  // ---- the loop ---------------------------------------------------------------------------------

  async function refresh() {
    const status = byId("status");
    try {
      const [run, history, evaluations] = await Promise.all(
        [getJSON("api/run"), getJSON("api/history"), getJSON("api/evaluations")]);
      refreshMs = Math.max(500, 1000 * run.refresh_seconds);
      renderRun(run);
      renderHistory(history);
      renderEvaluations(evaluations.evaluators);
      const read = run.members_read_at;
      status.textContent = read ? "DHT read " + ago(run.now - read) : "joining the swarm…";
      status.className = "status ok";
      document.body.dataset.updated = String(run.now);
    } catch (error) {
      status.textContent = "dashboard unreachable (" + error.message + "); retrying";
      status.className = "status error";
    } finally {
      setTimeout(refresh, refreshMs);
    }
  }

  refresh();
})();
