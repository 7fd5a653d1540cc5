// gpush dashboard. One module, no dependencies: it reads the broker's REST API with the
// token the user gave (kept in this tab's sessionStorage, sent as a Bearer header, never
// in a cookie) and writes every value into the page as text, never as markup.

const TOKEN_KEY = "gpush.token";
const ACTIVE = ["queued", "held", "routed", "submitting", "submitted", "running", "requeued"];
const STATES = [...ACTIVE, "succeeded", "failed", "cancelled"];
const TERMINAL = new Set(["succeeded", "failed", "cancelled"]);
const KINDS = ["training", "inference", "batch"];
const REFRESH_MS = 5000;
const PALETTE = ["#1f6feb", "#1a7f37", "#bf3989", "#9a6700", "#8250df", "#0a7e8c", "#d1242f", "#6e5494",
                 "#2da44e", "#e16f24", "#3b5bdb", "#a0522d"];

// ranks: the rank whose output each gang's page shows, kept while the page is redrawn.
const app = { who: null, timer: null, view: null, ticket: null, ranks: new Map() };

// -- small helpers ------------------------------------------------------------------------

function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "class") el.className = value;
    else if (key === "text") el.textContent = value;
    else if (key === "style") el.style.cssText = value;
    else if (key.startsWith("on")) el.addEventListener(key.slice(2), value);
    else el.setAttribute(key, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

// A page is drawn only if it is still the one asked for: a slow page that answers after
// the user moved on must not replace the newer one.
function current(ticket) {
  return ticket === app.ticket;
}

// A table in a container that scrolls sideways: a wide table is read by scrolling, never by
// breaking its words mid-word to fit.
function scrolling(attrs, ...children) {
  return h("div", { class: "scroll" }, h("table", attrs, ...children));
}

function mount(...children) {
  const main = document.getElementById("main");
  main.replaceChildren(...children.flat().filter((child) => child !== null && child !== undefined && child !== false));
  return main;
}

function errorBox(err) {
  return h("div", { class: "error", role: "alert", text: err.message || String(err) });
}

// Text with `commands` in backticks, the commands as code.
function withCode(text) {
  return String(text || "").split("`").map((part, i) => (i % 2 ? h("code", { text: part }) : part));
}

function badge(state) {
  return h("span", { class: `badge s-${state}`, text: state });
}

function ago(iso) {
  if (!iso) return "";
  const seconds = Math.max(0, (Date.now() - Date.parse(iso)) / 1000);
  if (seconds < 60) return `${Math.round(seconds)}s`;
  if (seconds < 3600) return `${Math.round(seconds / 60)}m`;
  if (seconds < 86400) return `${(seconds / 3600).toFixed(1)}h`;
  return `${(seconds / 86400).toFixed(1)}d`;
}

function when(iso) {
  return iso ? new Date(iso).toLocaleString() : "";
}

// The hour and minute only, in the reader's time zone and locale as when() (the API says UTC).
function clock(iso) {
  return iso ? new Date(iso).toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" }) : "";
}

function gpus(value) {
  return value === null || value === undefined ? "" : (Math.round(value * 100) / 100).toString();
}

const colours = new Map();
function tenantColour(tenant) {
  if (tenant === "(another tenant)") return "var(--outside)";
  if (!colours.has(tenant)) {
    let hash = 0;
    for (const c of tenant) hash = (hash * 31 + c.charCodeAt(0)) >>> 0;
    let colour = PALETTE[hash % PALETTE.length];
    // Distinct colours for the first tenants seen, hashed beyond the palette.
    const used = new Set(colours.values());
    for (let i = 0; used.has(colour) && i < PALETTE.length; i++) colour = PALETTE[(hash + i) % PALETTE.length];
    colours.set(tenant, colour);
  }
  return colours.get(tenant);
}

// -- the API ------------------------------------------------------------------------------

class ApiError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

async function api(path, { method = "GET", body } = {}) {
  const token = sessionStorage.getItem(TOKEN_KEY);
  const headers = { Accept: "application/json" };
  if (token) headers.Authorization = `Bearer ${token}`;
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const response = await fetch(path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body),
                                       credentials: "omit", cache: "no-store" });
  const text = await response.text();
  let data = null;
  try { data = text ? JSON.parse(text) : null; } catch { data = null; }
  if (!response.ok) {
    const message = data && data.error ? data.error.message : `${response.status} ${response.statusText}`;
    if (response.status === 401) {
      logout(message, true);
      throw new ApiError(401, message);
    }
    throw new ApiError(response.status, message);
  }
  return data;
}

function query(params) {
  const search = new URLSearchParams();
  for (const [key, value] of Object.entries(params)) {
    if (Array.isArray(value)) value.forEach((v) => search.append(key, v));
    else if (value !== "" && value !== null && value !== undefined) search.set(key, value);
  }
  const text = search.toString();
  return text ? `?${text}` : "";
}

// -- session ------------------------------------------------------------------------------

async function login(token) {
  sessionStorage.setItem(TOKEN_KEY, token.trim());
  try {
    app.who = await api("/v1/whoami");
  } catch (err) {
    sessionStorage.removeItem(TOKEN_KEY);
    app.who = null;
    throw err;
  }
  showWho();
}

function logout(message, failed = false) {
  sessionStorage.removeItem(TOKEN_KEY);
  app.who = null;
  document.getElementById("updated").textContent = "";
  showWho();
  renderLogin(message, failed);
}

function showWho() {
  const who = document.getElementById("who");
  const nav = document.getElementById("nav");
  if (!app.who) {
    who.replaceChildren();
    nav.hidden = true;
    return;
  }
  nav.hidden = false;
  nav.querySelector("[data-admin]").hidden = app.who.role !== "admin";
  who.replaceChildren(
    h("span", { "data-testid": "whoami", text: `${app.who.user} · tenant ${app.who.tenant} · ${app.who.role}` }),
    h("button", { onclick: () => logout("Signed out."), text: "Sign out" }),
  );
}

function renderLogin(message, failed = false) {
  stopRefresh();
  const input = h("input", { type: "password", name: "token", placeholder: "gpush_…", autocomplete: "off",
                             "aria-label": "API token" });
  const status = h("div");
  const form = h("form", { class: "panel login", onsubmit: async (event) => {
    event.preventDefault();
    status.replaceChildren();
    if (!input.value.trim()) {
      status.replaceChildren(errorBox({ message: "Paste your API token (gpush_…) first." }));
      return;
    }
    try {
      await login(input.value);
      location.hash = "#/queue";
      route();
    } catch (err) {
      // A refused token has re-drawn this form with the reason already (logout).
      if (!(err instanceof ApiError && err.status === 401)) status.replaceChildren(errorBox(err));
    }
  } },
  h("h1", { text: "Sign in to gpush" }),
  h("p", { class: "muted", text: "Paste an API token. `gpush dashboard` prints a sign-in link for the token " +
    "your CLI uses; an admin creates tokens with `gpush admin token create`. The token stays in this tab " +
    "only and is forgotten when the tab closes." }),
  input,
  h("button", { class: "primary", type: "submit", text: "Sign in" }),
  message && !failed ? h("p", { class: "muted", text: message }) : null,
  status);
  if (message && failed) status.append(errorBox({ message }));
  mount(form);
  input.focus();
}

// -- refreshing ---------------------------------------------------------------------------

function stopRefresh() {
  if (app.timer) clearInterval(app.timer);
  app.timer = null;
}

function every(refresh, periods = 1) {
  stopRefresh();
  app.timer = setInterval(() => {
    if (document.visibilityState === "visible") refresh().catch(() => {});
  }, REFRESH_MS * periods);
}

function stamp() {
  document.getElementById("updated").textContent = `updated ${new Date().toLocaleTimeString()} ·`;
}

// -- routing ------------------------------------------------------------------------------

function parseHash() {
  const raw = location.hash.replace(/^#\/?/, "");
  const [path, search = ""] = raw.split("?");
  return { parts: path.split("/").filter(Boolean), params: new URLSearchParams(search) };
}

async function route() {
  stopRefresh();
  const ticket = (app.ticket = Symbol("page"));
  if (takeTokenFromLink()) {
    try {
      await login(sessionStorage.getItem(TOKEN_KEY));
    } catch (err) {
      return renderLogin(err.message, true);
    }
  }
  if (!current(ticket)) return;
  if (!app.who) return renderLogin();
  const { parts, params } = parseHash();
  const view = parts[0] || "queue";
  for (const link of document.querySelectorAll("#nav a")) {
    link.classList.toggle("active", link.dataset.view === view || (view === "job" && link.dataset.view === "queue"));
  }
  app.view = view;
  try {
    if (view === "queue") await renderQueue(params, ticket);
    else if (view === "job") await renderJob(parts[1], ticket);
    else if (view === "inventory") await renderInventory(ticket);
    else if (view === "tenants") await renderTenants(ticket);
    else if (view === "admin") await renderAdmin(ticket);
    else mount(h("p", { text: "No such page." }), h("a", { href: "#/queue", text: "To the queue" }));
  } catch (err) {
    if (current(ticket) && !(err instanceof ApiError && err.status === 401)) mount(errorBox(err));
  }
}

// A sign-in link (#token=...) puts the token in this tab and takes it out of the address
// bar and the history; the fragment never reaches a server. True when there was one.
function takeTokenFromLink() {
  const match = location.hash.match(/^#token=([A-Za-z0-9_\-]+)/);
  if (!match) return false;
  sessionStorage.setItem(TOKEN_KEY, match[1]);
  history.replaceState(null, "", `${location.pathname}#/queue`);
  return true;
}

// -- queue --------------------------------------------------------------------------------

function queueFilters(params) {
  return {
    state: params.get("state") || "active",
    tenant: params.get("tenant") || "",
    user: params.get("user") || "",
    kind: params.get("kind") || "",
    cluster: params.get("cluster") || "",
    label: params.get("label") || "",
    limit: params.get("limit") || "50",
  };
}

function queueHash(filters, extra = {}) {
  const merged = { ...filters, ...extra };
  const search = new URLSearchParams();
  for (const [key, value] of Object.entries(merged)) {
    if (value && !(key === "state" && value === "active") && !(key === "limit" && value === "50")) search.set(key, value);
  }
  const text = search.toString();
  return `#/queue${text ? `?${text}` : ""}`;
}

async function renderQueue(params, ticket) {
  const filters = queueFilters(params);
  const cursors = [""]; // the cursor of each page seen, to go back
  let page = 0;
  const common = { tenant: filters.tenant, user: filters.user, kind: filters.kind, cluster: filters.cluster,
                   label: filters.label || null };
  const states = filters.state === "active" ? ACTIVE.join(",") : filters.state === "all" ? "" : filters.state;

  const tabs = h("div", { class: "tabs", "data-testid": "state-tabs" });
  const body = h("tbody");
  const info = h("span", { class: "muted" });
  const older = h("button", { text: "Older ›", onclick: () => { page += 1; load(); } });
  const newer = h("button", { text: "‹ Newer", onclick: () => { page -= 1; load(); } });
  const problem = h("div");

  const field = (name, labelText, attrs = {}) => h("label", {}, labelText,
    h("input", { name, value: filters[name], ...attrs }));
  const kind = h("select", { name: "kind" }, h("option", { value: "", text: "any" }),
    KINDS.map((k) => h("option", { value: k, text: k, selected: filters.kind === k })));
  const form = h("form", { class: "filters", onsubmit: (event) => {
    event.preventDefault();
    const data = Object.fromEntries(new FormData(form).entries());
    location.hash = queueHash({ ...filters, ...data });
  } },
  app.who.role === "admin" ? field("tenant", "tenant") : null,
  field("user", "user"),
  h("label", {}, "kind", kind),
  field("cluster", "cluster"),
  field("label", "label", { placeholder: "key=value" }),
  h("label", {}, "per page", h("select", { name: "limit" },
    ["25", "50", "100", "200"].map((n) => h("option", { value: n, text: n, selected: filters.limit === n })))),
  h("button", { type: "submit", text: "Filter" }),
  h("a", { class: "button", href: "#/queue", text: "Clear" }));

  async function loadCounts() {
    const counts = await api(`/v1/jobs:count${query(common)}`);
    const by = counts.by_state;
    const active = ACTIVE.reduce((sum, s) => sum + (by[s] || 0), 0);
    const tab = (value, text, n) => h("a", { href: queueHash(filters, { state: value }),
      class: filters.state === value ? "active" : "" }, text, h("span", { class: "n", text: n.toLocaleString() }));
    tabs.replaceChildren(tab("active", "active", active),
      ...STATES.filter((s) => by[s]).map((s) => tab(s, s, by[s])),
      tab("all", "all", counts.total));
  }

  async function load() {
    const cursor = cursors[page] || "";
    const result = await api(`/v1/jobs${query({ ...common, state: states, limit: filters.limit, cursor })}`);
    cursors[page + 1] = result.next_cursor || "";
    body.replaceChildren(...result.jobs.map(jobRow));
    if (!result.jobs.length) body.append(h("tr", {}, h("td", { colspan: 11, class: "muted", text: "No jobs here." })));
    older.disabled = !result.next_cursor;
    newer.disabled = page === 0;
    info.textContent = `page ${page + 1}`;
    stamp();
  }

  if (!current(ticket)) return;
  mount(h("h1", { text: "Queue" }), form, tabs, problem,
    scrolling({ "data-testid": "jobs" },
      h("thead", {}, h("tr", {}, ["job", "name", "state", "tenant", "user", "kind", "cluster", "GPUs asked",
        "GPUs held", "age", "why it waits / how it ended"].map((t, i) => h("th", { class: i === 8 ? "num" : "", text: t,
        title: i === 7 ? "per replica, or nodes x GPUs per node (as gpush list)" : i === 8 ? "GPU-equivalents held" : null })))),
      body),
    h("div", { class: "pager" }, newer, info, older));
  try {
    await Promise.all([load(), loadCounts()]);
  } catch (err) {
    // A filter the API refuses: say why beside the form, which stays to correct it.
    if (!(err instanceof ApiError && err.status === 401)) problem.replaceChildren(errorBox(err));
    return;
  }
  every(async () => {
    try {
      await Promise.all([load(), loadCounts()]);
      problem.replaceChildren();
    } catch (err) {
      problem.replaceChildren(errorBox(err));
    }
  });
}

function jobRow(job) {
  return h("tr", { "data-job": job.id },
    h("td", {}, h("a", { href: `#/job/${job.id}`, text: `#${job.id}` })),
    h("td", { class: "token", text: job.name || "" }),
    h("td", {}, badge(job.state)),
    h("td", { class: "token", text: job.tenant }),
    h("td", { class: "token", text: job.user }),
    h("td", { class: "token", text: job.kind }),
    h("td", { class: "token", text: job.cluster || "" }),
    h("td", { class: "token", "data-testid": "asked", text: job.gpu_request || "" }),
    h("td", { class: "num", text: gpus(job.gpu_equivalents) }),
    h("td", { title: when(job.created_at), text: ago(job.created_at) }),
    h("td", { class: "reason", text: job.state_reason || "" }));
}

// -- one job ------------------------------------------------------------------------------

async function renderJob(id, ticket = app.ticket, note = null) {
  if (!/^\d{1,18}$/.test(id || "")) {
    throw new Error(id ? `${id} is not a job id: the address is #/job/ and a number` : "give a job id: #/job/123");
  }
  const [job, events] = await Promise.all([api(`/v1/jobs/${id}`), api(`/v1/jobs/${id}/events`)]);
  if (!current(ticket)) return;
  const canCancel = !TERMINAL.has(job.state) && !job.cancel_requested_at &&
    (app.who.role === "admin" || (app.who.user === job.user && app.who.tenant === job.tenant));
  const status = h("div", {}, note ? h("p", { class: "note", role: "status", text: note }) : null);
  const cancel = canCancel ? h("button", { class: "danger", text: "Cancel job", onclick: async () => {
    if (!confirm(`Cancel job ${job.id} (${job.name || "unnamed"})?`)) return;
    try {
      const result = await api(`/v1/jobs/${job.id}/cancel`, { method: "POST" });
      const said = { cancelled: "Cancelled.", cancel_requested: "Cancel requested: the cluster stops the job, then it shows cancelled.",
        already_requested: "A cancel was already requested.", already_finished: "The job had already ended." };
      await renderJob(id, ticket, said[result.outcome] || `cancel: ${result.outcome}`);
    } catch (err) {
      status.replaceChildren(errorBox(err));
    }
  } }) : null;
  const explainOut = h("div");
  const explain = h("button", { text: "Explain routing", onclick: async () => {
    try {
      const result = await api("/v1/policy:explain", { method: "POST", body: { job_id: job.id } });
      explainOut.replaceChildren(h("pre", { "data-testid": "explain", text: explainText(result) }));
    } catch (err) {
      explainOut.replaceChildren(errorBox(err));
    }
  } });

  const p = job.placement || {};
  const where = [h("dl", { class: "kv", "data-testid": "placement" }, kv("GPUs asked", job.gpu_request),
    ...(job.placement ? [kv("cluster", p.cluster), kv(job.gang ? "rank 0's node" : "node", p.node),
      kv("sharing", p.sharing), kv("slice", p.mig_profile), kv("GPU model", p.gpu_model),
      kv("GPUs", (p.gpus || []).join(", ")), kv("replicas", p.replicas),
      kv("GPU-equivalents", gpus(p.gpu_equivalents)), kv("backend id", job.backend_id)] : [])),
    job.placement ? null : h("p", { class: "muted", text: "Not placed on a cluster." })];

  const output = h("div", { class: "muted", text: "…" });
  const showOutput = (rank) => {
    if (job.gang) app.ranks.set(job.id, rank);
    output.replaceChildren(h("span", { class: "muted", text: "…" }));
    api(`/v1/jobs/${job.id}/logs${query({ tail: 200, replica: job.gang ? rank : null })}`).then((out) => {
      if (!current(ticket)) return;
      output.replaceChildren(out.readable ? h("pre", { "data-testid": "logs", text: out.text || "(nothing yet)" })
        : h("p", { class: "muted", text: `${out.location}${out.note ? ` — ${out.note}` : ""}` }));
    }).catch((err) => output.replaceChildren(h("p", { class: "muted", text: err.message })));
  };
  const rank = job.gang ? Math.min(app.ranks.get(job.id) || 0, job.gang.ranks - 1) : null;
  mount(
    h("p", {}, h("a", { href: "#/queue", text: "‹ Queue" })),
    h("h1", {}, `Job #${job.id} `, job.name ? h("span", { class: "muted", text: job.name }) : null, " ", badge(job.state)),
    job.state_reason ? h("p", { class: job.state === "held" ? "note" : "muted", "data-testid": "reason",
      text: job.state_reason }) : null,
    h("p", {}, cancel, " ", explain), status, explainOut,
    h("div", { class: "grid2" },
      h("section", { class: "panel" }, h("h2", { text: "Where it runs" }), where,
        job.gang ? gangNodes(job.gang) : null,
        h("h2", { text: "Owner" }), h("dl", { class: "kv" }, kv("tenant", job.tenant), kv("user", job.user),
          kv("kind", job.kind), kv("isolation", job.isolation), kv("priority", job.priority),
          kv("submitted", when(job.created_at))),
        h("h2", { text: "Events" }), timeline(events)),
      h("section", { class: "panel" }, h("h2", { text: "Spec" }),
        h("pre", { "data-testid": "spec", text: JSON.stringify(job.spec, null, 2) }),
        h("h2", { text: "Output" }), job.gang && job.placement ? rankChooser(job.gang, rank, showOutput) : null,
        output)));
  stamp();
  if (!job.placement) {
    output.textContent = "No output: the job never reached a cluster.";
  } else showOutput(rank);
  if (!TERMINAL.has(job.state)) {
    every(async () => {
      const fresh = await api(`/v1/jobs/${job.id}`);
      if (fresh.state !== job.state || fresh.state_reason !== job.state_reason) await renderJob(id, ticket);
    });
  }
}

// A multi-node job's nodes with their ranks, as the API sends them (the same as gpush status).
function gangNodes(gang) {
  const tasks = gang.tasks_per_node;
  const ranks = (n) => (n.first_rank === n.last_rank ? `${n.first_rank}` : `${n.first_rank}–${n.last_rank}`);
  return [
    h("h2", { text: "Nodes and ranks" }),
    h("p", { class: "muted", text: `${gang.nodes.length} nodes, ${tasks} task${tasks === 1 ? "" : "s"} (rank${tasks === 1 ? "" : "s"}) per ` +
      `node, ${gang.ranks} ranks in all` }),
    scrolling({ class: "compact", "data-testid": "gang" },
      h("thead", {}, h("tr", {}, ["node", "name", tasks === 1 ? "rank" : "ranks"].map((t) => h("th", { text: t })))),
      h("tbody", {}, gang.nodes.map((n) => h("tr", { "data-node-index": n.index },
        h("td", { text: n.index }),
        h("td", { class: "token" }, n.node ? n.node : h("span", { class: "muted", text: "not placed yet" }),
          n.rendezvous ? h("span", { class: "muted", text: " (rendezvous)" }) : null),
        h("td", { text: ranks(n) }))))),
  ];
}

// Which rank's output to show: every rank, with its node.
function rankChooser(gang, rank, show) {
  const select = h("select", { name: "rank" }, gang.nodes.map((n) => {
    const options = [];
    for (let r = n.first_rank; r <= n.last_rank; r++) {
      options.push(h("option", { value: r, text: `rank ${r}${n.node ? ` on ${n.node}` : ""}`, selected: r === rank }));
    }
    return options;
  }).flat());
  select.addEventListener("change", () => show(Number(select.value)));
  return h("p", {}, h("label", {}, "rank", select));
}

function kv(key, value) {
  if (value === null || value === undefined || value === "") return null;
  return [h("dt", { text: key }), h("dd", { text: String(value) })];
}

function timeline(events) {
  return h("ol", { class: "timeline", "data-testid": "events" }, events.map((e) => h("li", { class: `s-${e.to_state}` },
    h("time", { datetime: e.at, text: when(e.at) }),
    e.type !== "transition" ? h("b", { text: e.type.replace("_", " ") })
      : [e.from_state ? `${e.from_state} → ` : "", h("b", { text: e.to_state })],
    e.actor ? h("span", { class: "muted", text: ` by ${e.actor}` }) : null,
    e.reason ? h("div", { class: "why", text: e.reason }) : null)));
}

function explainText(result) {
  const lines = [result.explain || ""];
  for (const p of result.placement || []) {
    lines.push(p.fits ? `→ ${p.route}: fits on ${p.placement.node || p.placement.cluster}` : `→ ${p.route}: ${p.reason}`);
  }
  return lines.join("\n");
}

// -- inventory ----------------------------------------------------------------------------

async function renderInventory(ticket) {
  const [inventory, holders] = await Promise.all([api("/v1/inventory"), api("/v1/inventory/occupancy")]);
  if (!current(ticket)) return;
  const began = performance.now();
  const byNode = new Map();
  for (const holder of holders) {
    const key = `${holder.cluster}\u0000${holder.node}`;
    if (!byNode.has(key)) byNode.set(key, []);
    byNode.get(key).push(holder);
  }
  const findingsByNode = new Map();
  for (const f of inventory.findings || []) {
    const key = `${f.cluster}\u0000${f.node}`;
    if (!findingsByNode.has(key)) findingsByNode.set(key, []);
    findingsByNode.get(key).push(f);
  }
  const tenants = [...new Set(holders.map((x) => x.tenant))].sort();
  const legend = h("div", { class: "legend", "data-testid": "legend" },
    tenants.map((t) => h("span", {}, h("i", { class: "swatch", style: `background:${tenantColour(t)}` }), t)),
    h("span", {}, h("i", { class: "swatch", style: "background:var(--free)" }), "free"),
    h("span", {}, h("i", { class: "swatch seg outside" }), "in use, not by gpush"),
    h("span", {}, h("i", { class: "swatch seg broken" }), "broken"));
  const sev = inventory.findings_by_severity || {};
  const sections = inventory.clusters.map((cluster) => {
    const t = cluster.totals || {};
    const used = t.capacity ? (t.allocated / t.capacity) * 100 : 0;
    const broken = t.capacity ? (t.broken / t.capacity) * 100 : 0;
    const grid = h("div", { class: "nodes" });
    const fragment = document.createDocumentFragment();
    for (const node of cluster.nodes) {
      const key = `${cluster.name}\u0000${node.name}`;
      fragment.append(nodeCard(node, byNode.get(key) || [], findingsByNode.get(key) || []));
    }
    grid.append(fragment);
    return h("section", { class: "cluster", "data-cluster": cluster.name },
      h("h2", {}, `${cluster.name} `, h("span", { class: "muted", text: `(${cluster.kind}, ${cluster.nodes.length} nodes)` })),
      cluster.error ? errorBox({ message: cluster.error }) : null,
      h("div", { class: "totals panel" },
        h("span", {}, h("span", { class: "meter", title: `${Math.round(used)}% allocated` },
          h("i", { style: `width:${used}%` }), h("i", { class: "broken", style: `width:${broken}%` }))),
        h("span", { text: `${gpus(t.allocated)} of ${gpus(t.capacity)} GPU-equivalents allocated` }),
        h("b", { text: `${gpus(t.free)} free` }),
        t.broken ? h("span", { class: "sev-critical", text: `${gpus(t.broken)} broken` }) : null,
        h("span", { class: "muted", text: Object.entries(cluster.by_sharing || {}).map(([s, v]) =>
          `${s} ${gpus(v.free)}/${gpus(v.capacity)} free`).join(" · ") })),
      grid);
  });
  mount(h("h1", { text: "Inventory" }),
    h("p", { class: "muted" }, "Every node of both tiers; each GPU is a bar split into its MIG instances, MPS " +
      "shares or time-slice replicas, coloured by the tenant that holds them. Findings: ",
      ["critical", "warning", "info"].map((s) => h("span", { class: sev[s] ? `sev-${s}` : "muted", text: ` ${sev[s] || 0} ${s}` })),
      app.who.role === "admin" ? h("a", { href: "#/admin", text: " (fixes on the Admin page)" }) : null),
    legend, ...sections);
  document.getElementById("main").dataset.renderMs = String(Math.round(performance.now() - began));
  stamp();
  // A large fleet takes a moment to draw: redrawn every 15 s, not every 5.
  every(async () => { if (current(ticket)) await renderInventory(ticket); }, 3);
}

// The units of a node drawn per physical GPU: a unit that spans n GPUs with capacity c has
// c/n instances on each; what is allocated is filled by the jobs that hold it (those that
// name their GPUs first), and what no job of gpush accounts for is shown as outside work.
// (A unit with capacity c spread over n GPUs is filled in GPU order.)
function nodeCard(node, holders, findings) {
  const rows = new Map(); // gpu key -> {label, segments}
  const queue = holders.map((x) => ({ ...x, left: x.units * x.replicas }));
  const take = (unit, gpu) => {
    const match = (x) => x.left > 0 && x.sharing === unit.sharing && (x.mig_profile || null) === (unit.mig_profile || null);
    let holder = queue.find((x) => match(x) && x.gpus.length && x.gpus.includes(gpu));
    if (!holder) holder = queue.find((x) => match(x) && !x.gpus.length);
    if (!holder) holder = queue.find(match);
    return holder;
  };
  // A job gpush placed holds its units even while the cluster still reports them free (a
  // pending Slurm job, a Pod not yet bound): what the jobs hold beyond what the cluster
  // reports, per sharing mode and slice, is drawn on the first free units.
  const unallocated = new Map();
  const groupOf = (x) => `${x.sharing} ${x.mig_profile || ""}`;
  const claimed = new Map();
  for (const x of queue) claimed.set(groupOf(x), (claimed.get(groupOf(x)) || 0) + x.left);
  for (const unit of node.units) claimed.set(groupOf(unit), (claimed.get(groupOf(unit)) || 0) - unit.allocated);
  for (const unit of node.units) {
    const extra = Math.min(Math.max(claimed.get(groupOf(unit)) || 0, 0), unit.broken ? 0 : unit.capacity - unit.allocated);
    if (extra > 0) {
      unallocated.set(unit, extra);
      claimed.set(groupOf(unit), claimed.get(groupOf(unit)) - extra);
    }
  }
  for (const unit of node.units) {
    const list = unit.reported_gpus && unit.reported_gpus.length ? unit.reported_gpus
      : unit.gpus && unit.gpus.length ? unit.gpus : [null];
    const per = unit.capacity % list.length === 0 ? unit.capacity / list.length : unit.capacity;
    const targets = unit.capacity % list.length === 0 ? list : [null];
    let allocated = unit.allocated + (unallocated.get(unit) || 0);
    for (const gpu of targets) {
      const key = gpu === null ? `${unit.sharing} ${unit.mig_profile || ""}` : `GPU ${gpu}`;
      if (!rows.has(key)) rows.set(key, { key, gpu, segments: [], kinds: new Set() });
      const row = rows.get(key);
      row.kinds.add(unit.sharing.split("/")[1]);
      const share = unit.gpu_equivalent * (gpu === null && list.length > 1 ? 1 / list.length : 1);
      // A narrow MIG instance shows its compute slices only (1g); the title has the rest.
      const narrow = share < 0.2;
      const label = unit.mig_profile ? (narrow ? unit.mig_profile.split(".")[0] : unit.mig_profile)
        : unit.sharing.endsWith("timeslice") ? (share < 0.2 ? "" : "replica") : "";
      if (per > 16) { // MPS percentages and the like: one used and one free block
        const usedHere = Math.min(allocated, per);
        allocated -= usedHere;
        const holder = usedHere ? take(unit, gpu) : null;
        if (holder) holder.left = Math.max(0, holder.left - usedHere);
        if (usedHere) row.segments.push({ width: usedHere * share, holder, unit, label: `${usedHere}%` });
        if (per - usedHere) row.segments.push({ width: (per - usedHere) * share, unit, free: true, label: "" });
        continue;
      }
      for (let i = 0; i < per; i++) {
        if (unit.broken) { row.segments.push({ width: share, unit, broken: true, label }); continue; }
        if (allocated > 0) {
          allocated -= 1;
          const holder = take(unit, gpu);
          if (holder) holder.left -= 1;
          row.segments.push({ width: share, unit, holder, label });
        } else {
          row.segments.push({ width: share, unit, free: true, label });
        }
      }
    }
  }
  const critical = findings.some((f) => f.severity === "critical");
  const keys = [...rows.keys()].sort((a, b) => (rows.get(a).gpu ?? 1e9) - (rows.get(b).gpu ?? 1e9));
  return h("article", { class: `node${critical ? " has-critical" : ""}`, "data-node": node.name },
    h("header", {}, h("b", { text: node.name }),
      h("span", { class: "meta", text: `${gpus(node.free_gpu_equivalents)} of ${gpus(node.capacity_gpu_equivalents)} free · agent ${node.agent}` }),
      node.reserved_for ? h("span", { class: "meta reserved", text: ` · reserved for job ${node.reserved_for.job_id} until ~${clock(node.reserved_for.start_by)}` }) : null),
    topologyLine(node),
    keys.map((key) => {
      const row = rows.get(key);
      const total = row.segments.reduce((s, x) => s + x.width, 0) || 1;
      return h("div", { class: "gpu", "data-gpu": row.gpu ?? "" },
        h("span", { class: "idx", text: row.gpu === null ? "pool" : key }),
        h("div", { class: "bar" }, row.segments.map((seg) => segment(seg, total))),
        h("span", { class: "kind", text: [...row.kinds].join(" ") }));
    }),
    findings.length ? h("ul", { class: "findings" }, findings.map((f) =>
      h("li", { class: `sev-${f.severity}`, title: f.fix || "", text: `${f.severity}: ${f.what}` }))) : null);
}

// How close a node's GPUs and the node itself are (the same fields `gpush inventory
// --topology` shows): its network domains, widest first, then its NVLink islands, PCIe
// switches and sockets by device index, and where they were read. Nothing when unknown.
function topologyLine(node) {
  const ranges = (group) => {
    const parts = [];
    for (const i of [...group].sort((a, b) => a - b)) {
      const last = parts[parts.length - 1];
      if (last && last[1] === i - 1) last[1] = i; else parts.push([i, i]);
    }
    return parts.map(([a, b]) => (b > a ? `${a}-${b}` : `${a}`)).join(",");
  };
  const bits = (node.topology || []).map((d) => `${d.level} ${d.domain ?? "(none)"}`);
  const t = node.gpu_topology;
  if (t) {
    const islands = (t.nvlink || []).filter((g) => g.length > 1);
    if ((t.nvlink || []).length) bits.push(islands.length ? `NVLink ${islands.map(ranges).join(" ")}` : "no NVLink");
    if ((t.pcie || []).length) bits.push(`PCIe ${t.pcie.map(ranges).join(" ")}`);
    if ((t.socket || []).length) bits.push(`socket ${t.socket.map(ranges).join(" ")}`);
    if (t.source) bits.push(`(${t.source})`);
  }
  if (!bits.length) return null;
  return h("div", { class: "meta topology", "data-testid": "topology", text: bits.join(" · ") });
}

// Thousands of these on a large fleet: built directly, without h()'s generic attributes.
function segment(seg, total) {
  const el = document.createElement("div");
  el.style.flex = `${seg.width / total} 1 0`;
  const what = `${seg.unit.sharing}${seg.unit.mig_profile ? ` ${seg.unit.mig_profile}` : ""}`;
  if (seg.broken) {
    el.className = "seg broken";
    el.title = `${what}: broken: ${seg.unit.broken}`;
  } else if (seg.free) {
    el.className = "seg free";
    el.title = `${what}: free`;
    el.textContent = seg.label;
  } else if (!seg.holder) {
    el.className = "seg outside";
    el.title = `${what}: in use, not by a gpush job`;
  } else {
    const x = seg.holder;
    el.className = "seg";
    el.style.background = tenantColour(x.tenant);
    el.title = `${what}: ${x.job ? `job #${x.job} ${x.name || ""} (${x.tenant}/${x.user})` : x.tenant}`;
    el.dataset.tenant = x.tenant;
    el.textContent = seg.label;
  }
  return el;
}

// -- tenants ------------------------------------------------------------------------------

async function renderTenants(ticket) {
  const rows = await api("/v1/tenants");
  if (!current(ticket)) return;
  // Shares come from the broker, over every tenant: a user's token sees the tenants it may
  // not name as one "(other tenants)" row, and the same numbers as an admin's.
  const max = Math.max(...rows.map((t) => Math.max(t.fair_share, t.gpu_share)), 0.01);
  mount(h("h1", { text: "Tenants" }),
    h("p", { class: "muted", text: "Fair share: each tenant's share of the GPUs in use (bar) against its share " +
      "of the weights (mark). Quota: the GPU-equivalents a tenant may hold at once." }),
    h("div", { class: "panel bars", "data-testid": "shares" }, rows.map((t) => {
      return h("div", { class: "row" }, h("span", { text: t.name }),
        h("div", { class: "track", title: `${Math.round(t.gpu_share * 100)}% of the GPUs in use; weight share ${Math.round(t.fair_share * 100)}%` },
          h("i", { style: `width:${(t.gpu_share / max) * 100}%;background:${tenantColour(t.name)}` }),
          h("b", { style: `left:${(t.fair_share / max) * 100}%` })),
        h("span", { class: "muted", text: `${Math.round(t.gpu_share * 100)}%` }));
    })),
    scrolling({ "data-testid": "tenants" },
      h("thead", {}, h("tr", {}, ["tenant", "weight", "fair share", "GPUs held", "quota", "quota used", "running",
        "waiting"].map((t, i) => h("th", { class: i ? "num" : "", text: t })))),
      h("tbody", {}, rows.map((t) => h("tr", {},
        h("td", { text: t.name }), h("td", { class: "num", text: t.weight }),
        h("td", { class: "num", text: `${Math.round(t.fair_share * 100)}%` }),
        h("td", { class: "num", text: gpus(t.gpu_used) }),
        h("td", { class: "num", text: t.gpu_quota === null ? "none" : gpus(t.gpu_quota) }),
        h("td", { class: "num", text: t.gpu_quota ? `${Math.round(t.gpu_used / t.gpu_quota * 100)}%` : "" }),
        h("td", { class: "num", text: t.jobs_running }), h("td", { class: "num", text: t.jobs_queued }))))));
  stamp();
  if (!rows.length) {
    document.getElementById("main").append(h("p", { class: "muted",
      text: "No tenant holds GPUs or has jobs queued right now." }));
  }
  every(async () => { if (current(ticket)) await renderTenants(ticket); });
}

// -- admin --------------------------------------------------------------------------------

async function renderAdmin(ticket = app.ticket, note = null) {
  if (app.who.role !== "admin") {
    mount(h("p", { class: "note", text: "Only an admin's token sees this page." }));
    return;
  }
  const [clusters, drift, history, changes, moves, fleet] = await Promise.all([api("/v1/clusters"),
    api("/v1/inventory/drift"), api("/v1/policy/history"), api("/v1/mig/changes?all=true&limit=20"),
    api("/v1/lending/moves?all=true&limit=20"), api("/v1/events?limit=50")]);
  const editor = await policyEditor(ticket);
  if (!current(ticket)) return;
  const findings = drift;
  const diffOut = h("div");
  const showDiff = async (a, b) => {
    try {
      const result = await api(`/v1/policy/diff${query({ a, b })}`);
      diffOut.replaceChildren(h("h2", { text: `Version ${a} → ${b}` }), diffBlock(result.diff));
    } catch (err) { diffOut.replaceChildren(errorBox(err)); }
  };
  const explainId = h("input", { name: "job", placeholder: "job id", inputmode: "numeric", size: 8 });
  const explainOut = h("div");
  mount(h("h1", { text: "Admin" }),
    h("h2", { text: "Clusters" }),
    scrolling({ "data-testid": "clusters" },
      h("thead", {}, h("tr", {}, ["cluster", "kind", "enabled", "health", "GPUs free / total", "detail"]
        .map((t) => h("th", { text: t })))),
      h("tbody", {}, clusters.map((c) => h("tr", {},
        h("td", { text: c.name }), h("td", { text: c.kind }), h("td", { text: c.enabled ? "yes" : "no" }),
        h("td", {}, h("span", { class: `badge ${c.health && c.health.ok ? "s-running" : "s-failed"}`,
          text: c.health && c.health.ok ? "ok" : "down" })),
        h("td", { class: "num", text: `${gpus(c.gpu_free)} / ${gpus(c.gpu_total)}` }),
        h("td", { class: "reason", text: (c.health && c.health.detail) || "" }))))),
    h("h2", { text: `Drift findings (${findings.length})` }),
    findings.length ? scrolling({ "data-testid": "findings" },
      h("thead", {}, h("tr", {}, ["severity", "where", "what", "why it matters", "fix"].map((t) => h("th", { text: t })))),
      h("tbody", {}, findings.map((f) => h("tr", {},
        h("td", { class: `sev-${f.severity}`, text: f.severity }),
        h("td", { text: [f.cluster, f.node, f.gpu === null || f.gpu === undefined ? null : `GPU ${f.gpu}`].filter(Boolean).join(" / ") }),
        h("td", { text: f.what }), h("td", { class: "reason", text: f.why }), h("td", { class: "reason" }, withCode(f.fix))))))
      : h("p", { class: "muted", text: "No drift: every cluster agrees with its node agents." }),
    ...fleetChanges(changes, moves, fleet),
    h("h2", { text: "Explain a job" }),
    h("form", { class: "filters", onsubmit: async (event) => {
      event.preventDefault();
      if (!/^\d{1,18}$/.test(explainId.value.trim()) || Number(explainId.value) < 1) {
        explainOut.replaceChildren(errorBox({ message: "Give a job's id: a number, such as 42." }));
        return;
      }
      try {
        const result = await api("/v1/policy:explain", { method: "POST", body: { job_id: Number(explainId.value) } });
        explainOut.replaceChildren(h("pre", { "data-testid": "explain", text: explainText(result) }));
      } catch (err) { explainOut.replaceChildren(errorBox(err)); }
    } }, explainId, h("button", { type: "submit", text: "Explain" })),
    explainOut,
    h("h2", { text: "Routing policy" }),
    scrolling({ "data-testid": "policy-history" },
      h("thead", {}, h("tr", {}, ["version", "author", "comment", "when", ""].map((t) => h("th", { text: t })))),
      h("tbody", {}, history.slice().reverse().map((v) => h("tr", {},
        h("td", {}, `${v.version} `, v.active ? h("span", { class: "badge s-running", text: "active" }) : null),
        h("td", { text: v.author }), h("td", { text: v.comment || "" }), h("td", { text: when(v.created_at) }),
        h("td", {}, v.version > 1 ? h("button", { text: "diff with previous",
          onclick: () => showDiff(v.version - 1, v.version) }) : null))))),
    diffOut,
    note ? h("p", { class: "note", role: "status", text: note }) : null,
    editor);
  stamp();
}

// MIG layout changes (gpush mig apply) and nodes lent between clusters, with every step.
function fleetChanges(changes, moves, fleet) {
  const layout = (slots) => (slots && slots.length ? slots.join(", ") : "no instance");
  const ended = (row) => ["done", "rolled-back", "cancelled", "called-off"].includes(row.step) ? "s-succeeded"
    : row.step === "failed" ? "s-failed" : "s-running";
  return [
    h("h2", { text: "MIG changes and node moves" }),
    changes.length ? scrolling({ "data-testid": "mig-changes" },
      h("thead", {}, h("tr", {}, ["change", "node / GPU", "layout", "step", "last"].map((t) => h("th", { text: t })))),
      h("tbody", {}, changes.map((c) => h("tr", {},
        h("td", { text: `MIG ${c.id}` }), h("td", { text: `${c.cluster} / ${c.node} / GPU ${c.gpu}` }),
        h("td", { class: "reason", text: `${layout(c.from)} → ${layout(c.to)}` }),
        h("td", {}, h("span", { class: `badge ${ended(c)}`, text: c.rolling_back && !["rolled-back", "failed"]
          .includes(c.step) ? `${c.step} (rolling back)` : c.step })),
        h("td", { class: "reason", text: c.events.length ? c.events[c.events.length - 1].note : "" })))))
      : h("p", { class: "muted", text: "No MIG change yet: gpush mig apply makes them, or the policy's mig section." }),
    moves.length ? scrolling({ "data-testid": "node-moves" },
      h("thead", {}, h("tr", {}, ["move", "node", "from → to", "step", "why"].map((t) => h("th", { text: t })))),
      h("tbody", {}, moves.map((m) => h("tr", {},
        h("td", { text: `move ${m.id}` }), h("td", { text: m.node }), h("td", { text: `${m.source} → ${m.target}` }),
        h("td", {}, h("span", { class: `badge ${ended(m)}`, text: m.step })),
        h("td", { class: "reason", text: m.reason })))))
      : h("p", { class: "muted", text: "No node lent yet: the policy's lending pools lend them." }),
    fleet.length ? h("details", {},
      h("summary", { text: `Every step (${fleet.length} newest)` }),
      h("ol", { class: "timeline", "data-testid": "fleet-events" }, fleet.slice().reverse().map((e) => h("li", {},
        h("time", { datetime: e.at, text: when(e.at) }),
        h("b", { text: `${e.kind === "mig-change" ? "MIG" : "move"} ${e.id} ${e.step}` }),
        h("span", { class: "muted", text: ` ${e.node} (${e.where})` }),
        h("div", { class: "why", text: e.note }))))) : null,
  ];
}

function diffBlock(text) {
  return h("pre", { class: "diff", "data-testid": "diff" }, text.split("\n").map((line) => h("span", {
    class: line.startsWith("@@") ? "hunk" : line.startsWith("+") && !line.startsWith("+++") ? "add"
      : line.startsWith("-") && !line.startsWith("---") ? "del" : "", text: `${line}\n` })));
}

async function policyEditor(ticket) {
  let active = null;
  try { active = await api("/v1/policy"); } catch (err) { if (err.status !== 404) throw err; }
  const text = h("textarea", { rows: 16, name: "policy", spellcheck: "false" });
  text.value = active ? active.text : "";
  const comment = h("input", { name: "comment", placeholder: "why this change (required)", size: 40,
    "aria-label": "comment" });
  const out = h("div");
  let checked = null;
  const apply = h("button", { class: "primary", text: "Apply", disabled: true, onclick: async () => {
    if (text.value !== checked) { apply.disabled = true; return; }
    if (!comment.value.trim()) {
      out.replaceChildren(errorBox({ message: "Say why in the comment first: it is the policy's history." }));
      comment.focus();
      return;
    }
    try {
      const result = await api("/v1/policy", { method: "POST", body: { text: text.value, comment: comment.value.trim(),
        base_version: active ? active.version : null } });
      // The history, the heading and the base version all change: the page is drawn again.
      await renderAdmin(ticket, result.changed ? `Applied: version ${result.version} is active.`
        : "Nothing changed: this text is the active version.");
    } catch (err) { out.replaceChildren(errorBox(err)); }
  } });
  text.addEventListener("input", () => { apply.disabled = true; });
  const check = h("button", { text: "Check and show the diff", onclick: async () => {
    try {
      const report = await api("/v1/policy:validate", { method: "POST", body: { text: text.value } });
      const ok = !(report.errors && report.errors.length);
      checked = ok ? text.value : null;
      apply.disabled = !ok || !report.diff;
      out.replaceChildren(h("pre", { class: "wrap", text: report.describe || "" }),
        report.diff ? diffBlock(report.diff) : h("p", { class: "muted", text: "No change from the active version." }));
    } catch (err) { out.replaceChildren(errorBox(err)); }
  } });
  return h("section", { class: "panel" }, h("h2", { text: active ? `Edit (from version ${active.version})` : "Edit" }),
    text, h("p", {}, comment, " ", check, " ", apply,
      h("span", { class: "muted", text: " Applying shows the diff first: check, read it, then apply." })), out);
}

// -- start --------------------------------------------------------------------------------

async function start() {
  window.addEventListener("hashchange", route);
  takeTokenFromLink();
  if (sessionStorage.getItem(TOKEN_KEY)) {
    try {
      await login(sessionStorage.getItem(TOKEN_KEY));
    } catch (err) {
      return renderLogin(err.message, true);
    }
  }
  await route();
}

start();
