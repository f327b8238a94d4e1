// kvgate console: live updates over the API's event streams, through the
// console's forwarder (/console/api/v1/...), which carries the session.
"use strict";
(function () {
  var page = document.body.dataset.page;
  var api = "/console/api";

  function text(el, v) { if (el && el.textContent !== String(v)) el.textContent = v; }
  function pct(f) { return (Math.round(f * 1000) / 10) + "%"; }

  // Fleet: one "fleet" event a second; each backend's card and its chart
  // of the last five minutes of KV use.
  var history = {}, windowMs = 5 * 60 * 1000;
  function draw(svg, points, target) {
    var ns = "http://www.w3.org/2000/svg";
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    var now = points.length ? points[points.length - 1][0] : 0;
    // The x axis spans what has been seen, from 30 s up to five minutes.
    var span = points.length ? Math.min(windowMs, Math.max(30000, now - points[0][0])) : windowMs;
    function x(t) { return 300 - (now - t) / span * 300; }
    function y(v) { return 80 - Math.min(1, Math.max(0, v)) * 78 - 1; }
    if (target) {
      var tl = document.createElementNS(ns, "line");
      tl.setAttribute("x1", "0"); tl.setAttribute("x2", "300");
      tl.setAttribute("y1", y(target)); tl.setAttribute("y2", y(target));
      tl.setAttribute("class", "target");
      svg.appendChild(tl);
    }
    var pl = document.createElementNS(ns, "polyline");
    pl.setAttribute("points", points.map(function (p) { return x(p[0]).toFixed(1) + "," + y(p[1]).toFixed(1); }).join(" "));
    pl.setAttribute("class", "use");
    svg.appendChild(pl);
  }
  function fleet() {
    var status = document.getElementById("fleet-live");
    var es = new EventSource(api + "/v1/fleet/events");
    es.onopen = function () { text(status, "Live updates: on"); };
    es.onerror = function () { text(status, "Live updates: reconnecting…"); };
    es.addEventListener("fleet", function (e) {
      var f = JSON.parse(e.data);
      f.backends.forEach(function (b) {
        var card = document.querySelector('[data-backend="' + CSS.escape(b.name) + '"]');
        if (!card) return;
        var field = function (n) { return card.querySelector('[data-field="' + n + '"]'); };
        text(field("kv"), b.kv_usage == null ? "not published" : pct(b.kv_usage));
        text(field("capacity"), b.capacity_tokens);
        text(field("running"), b.running);
        text(field("waiting"), b.waiting);
        text(field("preemptions"), b.preemptions);
        text(field("inflight"), b.inflight);
        var rs = Object.keys(b.refusals || {}).sort().map(function (r) { return r + ": " + b.refusals[r]; });
        text(field("refusals"), rs.length ? rs.join(" ") : "none");
        text(field("state"), b.ejected ? "ejected" : b.cooling ? "cooling down" : b.stale ? "metrics stale" : b.routable ? "routable" : "not routable");
        var h = history[b.name] = history[b.name] || [];
        if (b.kv_usage != null) h.push([f.at_ms, b.kv_usage]);
        while (h.length && h[0][0] < f.at_ms - windowMs) h.shift();
        var svg = card.querySelector("[data-chart]");
        if (svg) draw(svg, h, f.kv_target);
      });
      Object.keys(f.queued || {}).forEach(function (c) { text(document.getElementById("queued-" + c), f.queued[c]); });
    });
  }

  // Jobs, reviews, dead letters: the tenant's job events move each shown
  // job's state.
  function tenantQuery() { // an admin's page for another tenant (?tenant=) reads that tenant's
    var t = new URLSearchParams(location.search).get("tenant");
    return t ? "?tenant=" + encodeURIComponent(t) : "";
  }
  function jobs() {
    var es = new EventSource(api + "/v1/events" + tenantQuery());
    function apply(e) {
      var ev = JSON.parse(e.data);
      var list = ev.data || [ev];
      list.forEach(function (j) {
        var id = j.job_id || j.id, st = j.state;
        document.querySelectorAll('[data-job="' + CSS.escape(id) + '"] [data-field="state"]').forEach(function (el) { text(el, st); });
      });
    }
    jobEvents.forEach(function (t) { es.addEventListener(t, apply); });
  }

  // A job's page: its own stream, listed as it comes.
  function job() {
    var ol = document.getElementById("job-events");
    if (!ol) return;
    var es = new EventSource(api + "/v1/jobs/" + encodeURIComponent(ol.dataset.job) + "/events" + tenantQuery());
    function add(e) {
      var ev = JSON.parse(e.data);
      var li = document.createElement("li");
      li.textContent = (e.type || "event") + ": " + (ev.state || "") + (ev.state_version ? " (version " + ev.state_version + ")" : "");
      ol.appendChild(li);
      var st = document.querySelector('[data-job="' + CSS.escape(ol.dataset.job) + '"] [data-field="state"]');
      if (ev.state) text(st, ev.state);
      // A job's stream ends after its final state (REVIEW_REQUIRED waits
      // on for the decision): do not reconnect.
      if (["SUCCEEDED", "FAILED_TERMINAL", "CANCELLED", "SUPERSEDED"].indexOf(ev.state) >= 0) es.close();
    }
    jobEvents.forEach(function (t) { es.addEventListener(t, add); });
  }

  // The job event types: "job." and the state in lower case, but for
  // READY (job.accepted) and FAILED_TERMINAL (job.dead_lettered).
  var jobEvents = ["snapshot", "job.accepted", "job.running", "job.retry_scheduled", "job.succeeded",
    "job.review_required", "job.dead_lettered", "job.cancelled", "job.superseded"];

  // Queues: a "queues" event a second (the fleet stream with
  // include=queues) redraws the classes' tables and the backlog's rows.
  function duration(ms) { // as Go prints a time.Duration of whole ms
    if (ms === 0) return "0s";
    if (ms < 1000) return ms + "ms";
    var s = ms / 1000, m = Math.floor(s / 60);
    s = Math.round((s - m * 60) * 1000) / 1000;
    return (m > 0 ? m + "m" : "") + s + "s";
  }
  function row(tr, cells) {
    cells.forEach(function (c) {
      var td = document.createElement("td");
      td.textContent = c[0];
      if (c[1]) td.dataset.field = c[1];
      tr.appendChild(td);
    });
    return tr;
  }
  function rows(tbody, items, empty, cols, make) {
    var trs = items.map(make);
    if (!trs.length) {
      var tr = document.createElement("tr"), td = document.createElement("td");
      td.colSpan = cols;
      td.textContent = empty;
      tr.appendChild(td);
      trs = [tr];
    }
    tbody.replaceChildren.apply(tbody, trs);
  }
  function queues() {
    var status = document.getElementById("live-status");
    var es = new EventSource(api + "/v1/fleet/events?include=queues");
    es.onopen = function () { text(status, "Live updates: on"); };
    es.onerror = function () { text(status, "Live updates: reconnecting…"); };
    es.addEventListener("queues", function (e) {
      var q = JSON.parse(e.data);
      q.classes.forEach(function (c) {
        text(document.getElementById("class-" + c.class), c.class + ": " + c.queued + " waiting in kvgate");
        var table = document.getElementById("shares-" + c.class);
        if (!table) return;
        rows(table.tBodies[0], c.tenants, "No tenant has waited or been admitted here.", 9, function (t) {
          var tr = document.createElement("tr");
          tr.dataset.tenant = t.tenant;
          return row(tr, [[t.tenant], [t.weight], [t.queued], [t.queued_tokens], [duration(t.oldest_wait_ms)],
            [t.admitted, "admitted"], [t.admitted_tokens], [pct(t.share), "share"], [pct(t.weight_share), "weight-share"]]);
        });
      });
      var bl = document.getElementById("backlog-table");
      if (bl && q.backlog_at_ms) {
        rows(bl.tBodies[0], q.backlog, "Nothing runnable waits.", 5, function (b) {
          var tr = document.createElement("tr");
          tr.dataset.tenant = b.tenant;
          return row(tr, [[b.tenant], [b.class], [b.jobs, "jobs"], [b.tokens], [duration(Math.round(b.oldest_eligible_age_s) * 1000)]]);
        });
      }
    });
  }

  if (page === "fleet") fleet();
  if (page === "queues") queues();
  if (page === "jobs" || page === "reviews" || page === "deadletters") jobs();
  if (page === "job") job();
})();
