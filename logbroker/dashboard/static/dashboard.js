"use strict";

// The operator console: polls the JSON /metrics every POLL_MS and fills the page in. Every value
// is written with textContent, never as HTML (topic names come from clients).
(() => {
  const POLL_MS = 1500;
  const RETRY_MS = 5000;
  // Rate samples kept for the sparklines: two minutes at one per poll.
  const HISTORY = 80;

  const integer = new Intl.NumberFormat("en-US");
  const history = { produce: [], consume: [] };

  const byId = (id) => document.getElementById(id);

  function setText(id, value) {
    byId(id).textContent = value;
  }

  function count(value) {
    return typeof value === "number" ? integer.format(value) : "–";
  }

  function rate(value) {
    if (typeof value !== "number") return "–";
    return value >= 100 ? integer.format(Math.round(value)) : value.toFixed(1);
  }

  function bytes(value) {
    if (typeof value !== "number") return "–";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let scaled = value;
    let unit = 0;
    while (scaled >= 1024 && unit < units.length - 1) {
      scaled /= 1024;
      unit += 1;
    }
    return `${unit === 0 ? scaled : scaled.toFixed(1)} ${units[unit]}`;
  }

  function byteRate(value) {
    return typeof value === "number" ? `${bytes(value)}/s` : "– B/s";
  }

  function duration(seconds) {
    const s = Math.floor(seconds);
    const days = Math.floor(s / 86400);
    const hours = Math.floor((s % 86400) / 3600);
    const minutes = Math.floor((s % 3600) / 60);
    if (days > 0) return `${days}d ${hours}h`;
    if (hours > 0) return `${hours}h ${minutes}m`;
    if (minutes > 0) return `${minutes}m ${s % 60}s`;
    return `${s}s`;
  }

  // Replace a table body's rows: each row is a list of [text, className] cells.
  function fillRows(tableId, rows) {
    const body = byId(tableId).tBodies[0];
    const fresh = document.createElement("tbody");
    for (const cells of rows) {
      const tr = document.createElement("tr");
      for (const [text, className] of cells) {
        const td = document.createElement("td");
        td.textContent = text;
        if (className) td.className = className;
        tr.append(td);
      }
      fresh.append(tr);
    }
    body.replaceWith(fresh);
    const empty = byId(`${tableId}-empty`);
    if (empty) empty.hidden = rows.length > 0;
    byId(tableId).hidden = rows.length === 0;
  }

  function pairs(tableId, list) {
    fillRows(tableId, list.map(([name, n]) => [[name, "mono"], [count(n), "num"]]));
  }

  function drawSpark(canvas, values) {
    const ratio = window.devicePixelRatio || 1;
    const width = canvas.clientWidth * ratio;
    const height = canvas.clientHeight * ratio;
    if (canvas.width !== width || canvas.height !== height) {
      canvas.width = width;
      canvas.height = height;
    }
    const context = canvas.getContext("2d");
    context.clearRect(0, 0, width, height);
    if (values.length < 2) return;
    const top = Math.max(...values, 1);
    // Spread over the whole width from the start; once HISTORY samples are kept, it scrolls.
    const step = width / (values.length - 1);
    const y = (value) => height - 2 * ratio - (value / top) * (height - 4 * ratio);
    const colour = getComputedStyle(canvas).color;
    context.beginPath();
    values.forEach((value, i) => {
      const x = i * step;
      if (i === 0) context.moveTo(x, y(value));
      else context.lineTo(x, y(value));
    });
    context.strokeStyle = colour;
    context.lineWidth = 1.5 * ratio;
    context.stroke();
    context.lineTo(width, height);
    context.lineTo(0, height);
    context.closePath();
    context.globalAlpha = 0.15;
    context.fillStyle = colour;
    context.fill();
    context.globalAlpha = 1;
  }

  function remember(kind, value) {
    const list = history[kind];
    // No rate yet (the broker's first sample): nothing to draw, rather than a false zero.
    if (typeof value === "number") list.push(value);
    if (list.length > HISTORY) list.shift();
    drawSpark(byId(`${kind}-history`), list);
  }

  // The Cluster card: every node the answering node knows of, alive or dead; hidden when the
  // broker has no view of its cluster (cluster is null).
  function renderCluster(cluster) {
    byId("cluster").hidden = !cluster;
    if (!cluster) return;
    const alive = cluster.nodes.filter((n) => n.state === "alive").length;
    setText("cluster-summary", `${alive} of ${cluster.nodes.length} nodes alive`);
    setText("cluster-id", cluster.cluster_id);
    setText("cluster-control-plane", cluster.control_plane);
    setText("cluster-chores", cluster.chores_holder === null ? "nobody" : cluster.chores_holder);
    byId("cluster-chores").classList.toggle("alert", cluster.chores_holder === null);
    setText("cluster-violations", count(cluster.domain_violations));
    byId("cluster-violations").classList.toggle("alert", cluster.domain_violations > 0);
    setText("cluster-under-replicated", count(cluster.under_replicated));
    byId("cluster-under-replicated").classList.toggle("alert", cluster.under_replicated > 0);
    setText("peer-connections", count(cluster.peers.connections));
    setText("peer-bytes-in", bytes(cluster.peers.bytes_in));
    setText("peer-bytes-out", bytes(cluster.peers.bytes_out));
    fillRows(
      "cluster-nodes",
      cluster.nodes.map((n) => {
        const roles = [];
        if (n.answering) roles.push("this node");
        if (n.chores) roles.push("chores lease");
        const attributes = Object.entries(n.attributes).map(([k, v]) => `${k}=${v}`);
        return [
          [n.node_id, "mono"],
          [n.state, `state ${n.state}`],
          [n.address, "mono"],
          // 0: the node listens on no peer port (a single node).
          [n.peer_port > 0 ? String(n.peer_port) : "–", "num"],
          [attributes.length > 0 ? attributes.join(", ") : "–", "mono"],
          [count(n.segments_led), "num"],
          [roles.join(" · "), "roles"],
        ];
      }),
    );
  }

  function render(data) {
    const { node, system, storage, throughput, topics, connections, cluster } = data;

    const status = byId("node-status");
    status.textContent = node.status;
    status.className = `pill ${node.status}`;
    setText("node-uptime", duration(node.uptime_seconds));
    setText("node-version", node.version);
    setText("node-mode", node.mode);

    setText("produce-rate", rate(throughput.produce_rate));
    setText("consume-rate", rate(throughput.consume_rate));
    setText("produce-bytes-rate", byteRate(throughput.produce_bytes_rate));
    setText("consume-bytes-rate", byteRate(throughput.consume_bytes_rate));
    setText("records-produced", count(throughput.records_produced));
    setText("records-consumed", count(throughput.records_consumed));
    remember("produce", throughput.produce_rate);
    remember("consume", throughput.consume_rate);

    setText("connections-open", count(connections.open));
    setText("sessions-active", count(system.sessions.active));
    setText("connection-blocks", count(system.rate_limiting.connection_blocks));

    setText("storage-bytes", bytes(storage.bytes));
    setText("storage-ranges", count(storage.ranges));
    setText("storage-segments", count(storage.segments));
    setText("storage-sealed", count(storage.sealed_segments));

    setText("topic-count", topics.length === 1 ? "1 topic" : `${topics.length} topics`);
    fillRows(
      "topics",
      topics.map((topic) => [
        [topic.name, "mono"],
        [count(topic.ranges), "num"],
        [count(topic.segments), "num"],
        [bytes(topic.bytes), "num"],
        [count(topic.records_produced), "num"],
        [count(topic.records_consumed), "num"],
        [rate(topic.produce_rate), "num rate"],
        [rate(topic.consume_rate), "num rate"],
      ]),
    );

    const limits = system.rate_limiting;
    setText("rate-limiting-enabled", limits.enabled ? "on" : "off");
    setText("auth-blocked", count(limits.auth_blocked));
    setText("dashboard-auth-blocked", count(system.dashboard.auth_blocked));
    setText("publish-blocked", count(limits.publish_blocked));
    setText("subscribe-blocked", count(limits.subscribe_blocked));
    setText("refused-per-ip", count(connections.refused.per_ip));
    setText("refused-global", count(connections.refused.global));
    setText("sessions-expired", count(system.sessions.expired));
    setText("sessions-hijack", count(system.sessions.hijack_attempts));
    pairs("top-blocked", limits.top_auth_blocked);

    setText("scrub-verified", count(storage.scrub.verified));
    setText("scrub-repaired", count(storage.scrub.repaired));
    setText("scrub-unrepairable", count(storage.scrub.unrepairable));
    byId("scrub-unrepairable").classList.toggle("alert", storage.scrub.unrepairable > 0);
    renderMaintenance(storage.scrub, storage.retention);
    setText("damaged-segments", count(storage.damaged_segments));
    byId("damaged-segments").classList.toggle("alert", storage.damaged_segments > 0);
    pairs(
      "integrity-failures",
      Object.entries(storage.integrity_failures).filter(([, n]) => n > 0),
    );

    pairs("connections-top", connections.top);
    renderCluster(cluster);
    setText("updated", new Date().toLocaleTimeString());
  }

  function when(seconds) {
    return typeof seconds === "number" ? new Date(seconds * 1000).toLocaleString() : "never yet";
  }

  function renderMaintenance(scrub, retention) {
    let state = "off";
    if (scrub.enabled) {
      state = `${count(scrub.segments_per_tick)} segments every ${count(scrub.interval_ms)} ms`;
      if (typeof scrub.full_pass === "number") {
        state += `; a full pass over ${count(scrub.full_pass)} segments is running`;
      }
    }
    setText("scrub-state", state);
    setText("scrub-last-cycle", scrub.enabled ? when(scrub.last_cycle_at) : "–");
    byId("scrub-now").disabled = !scrub.enabled || typeof scrub.full_pass === "number";
    const unrepairable = scrub.unrepairable_segments || [];
    fillRows(
      "scrub-unrepairable-segments",
      unrepairable.map((entry) => [[entry.segment, "alert"], [entry.detail, ""]]),
    );
    byId("scrub-unrepairable-segments-empty").hidden = unrepairable.length > 0;

    const limits = [];
    if (typeof retention.max_age_ms === "number") {
      limits.push(`age ${duration(retention.max_age_ms / 1000)}`);
    }
    if (typeof retention.max_bytes === "number") {
      limits.push(`${bytes(retention.max_bytes)} per range`);
    }
    setText("retention-limits", retention.enabled ? limits.join(", ") : "off: every segment is kept");
    setText("retention-segments", count(retention.segments_removed));
    setText("retention-bytes", bytes(retention.bytes_removed));
    setText("retention-last-pass", retention.enabled ? when(retention.last_pass_at) : "–");
  }

  async function scrubNow() {
    const result = byId("scrub-now-result");
    result.textContent = "";
    try {
      const response = await fetch("/scrub", { method: "POST", credentials: "same-origin" });
      const body = await response.json();
      result.textContent = response.ok
        ? `Started: ${count(body.scrub.full_pass)} sealed segments to check.`
        : `Refused: ${body.message || body.reason}`;
    } catch (error) {
      result.textContent = `The broker cannot be reached (${error.message}).`;
    }
  }

  function banner(text) {
    const element = byId("banner");
    element.textContent = text;
    element.hidden = text === "";
  }

  async function poll() {
    let delay = POLL_MS;
    try {
      const response = await fetch("/metrics", {
        headers: { Accept: "application/json" },
        credentials: "same-origin",
        cache: "no-store",
      });
      if (response.status === 401 || response.status === 403) {
        // The session ended (expired, revoked, signed out elsewhere): back to the sign-in form.
        window.location.assign("/");
        return;
      }
      if (response.status === 429) {
        const body = await response.json();
        delay = Math.max(body.retry_after_ms, POLL_MS);
        banner(`Rate limited by the broker: next update in ${Math.ceil(delay / 1000)} s.`);
      } else if (!response.ok) {
        delay = RETRY_MS;
        banner(`The broker answered /metrics with status ${response.status}; retrying.`);
      } else {
        render(await response.json());
        banner("");
      }
    } catch (error) {
      delay = RETRY_MS;
      banner(`The broker cannot be reached (${error.message}); retrying.`);
    }
    window.setTimeout(poll, delay);
  }

  async function signOut() {
    await fetch("/logout", { credentials: "same-origin" }).catch(() => undefined);
    window.location.assign("/");
  }

  document.addEventListener("DOMContentLoaded", () => {
    byId("logout").addEventListener("click", signOut);
    byId("scrub-now").addEventListener("click", scrubNow);
    poll();
  });
})();
