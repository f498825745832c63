#!/usr/bin/env node
// curfew-node: a Node caller of curfew's OrchestratorService over gRPC.
//
//   node dist/client.js run   (--plan FILE | --task TEXT) [--deadline 30s] [--criticality critical|sheddable]
//   node dist/client.js start (--plan FILE | --task TEXT) [--key KEY] [--timeout 5m]
//   node dist/client.js get RUN_ID
//   node dist/client.js cancel RUN_ID [--reason TEXT]
//
// Common flags: --addr HOST:PORT (else $CURFEW_ADDR, else 127.0.0.1:7700), --tenant NAME,
// --ca FILE (else $CURFEW_CA: the mesh CA, `curfew up`'s DATA_DIR/tls/ca.crt, to call a
// mesh that runs mTLS; the orchestrator's public API needs no client certificate),
// --json (one JSON object per line instead of text). $CURFEW_API_KEY is the tenant's API
// key (`curfew tenant create`), sent as `authorization: Bearer`; it names the tenant, so
// --tenant is then ignored by the orchestrator. See README.md beside this file and
// docs/api.md for the contract it follows.
import { readFileSync } from "node:fs";
import { randomUUID } from "node:crypto";
import { parseArgs } from "node:util";

import { create, fromBinary } from "@bufbuild/protobuf";
import { DurationSchema, timestampMs, type Timestamp } from "@bufbuild/protobuf/wkt";
import { BinaryReader, WireType } from "@bufbuild/protobuf/wire";
import { Code, ConnectError, createClient, type Client } from "@connectrpc/connect";
import { createGrpcTransport } from "@connectrpc/connect-node";

import { CancelCause, NodeKind, NodeStatus, type Node } from "./gen/curfew/mesh/v1/mesh_pb.js";
import {
  OrchestratorService,
  RunStatus,
  type Run,
} from "./gen/curfew/orchestrator/v1/orchestrator_pb.js";

// The metadata contract (mesh/md in the Go code; docs/api.md).
const H = {
  deadline: "curfew-deadline", // absolute deadline, Unix ms, beside grpc-timeout
  tenant: "curfew-tenant",
  retryId: "curfew-retry-id", // one per logical call, the same on every attempt
  attempt: "curfew-attempt", // 1, 2, ... per attempt
  idempotencyKey: "curfew-idempotency-key",
  criticality: "curfew-criticality", // critical (default) | sheddable
} as const;

type Orchestrator = Client<typeof OrchestratorService>;

const usage = `usage:
  curfew-node run   (--plan FILE | --task TEXT) [--deadline 30s] [--criticality critical|sheddable]
  curfew-node start (--plan FILE | --task TEXT) [--key KEY] [--timeout 5m]
  curfew-node get RUN_ID
  curfew-node cancel RUN_ID [--reason TEXT]
flags: --addr HOST:PORT ($CURFEW_ADDR, 127.0.0.1:7700) --ca FILE ($CURFEW_CA) --tenant NAME --json`;

const { values: flags, positionals } = parseArgs({
  allowPositionals: true,
  options: {
    addr: { type: "string" },
    ca: { type: "string" },
    tenant: { type: "string" },
    json: { type: "boolean", default: false },
    plan: { type: "string" },
    task: { type: "string" },
    model: { type: "string" },
    deadline: { type: "string", default: "30s" },
    criticality: { type: "string" },
    key: { type: "string" },
    timeout: { type: "string" },
    reason: { type: "string" },
  },
});

const json = flags.json ?? false;

// out prints one event: a JSON line with --json, else the text.
function out(event: string, fields: Record<string, unknown>, text: string): void {
  if (json) {
    console.log(JSON.stringify({ event, ...fields }));
  } else if (text !== "") {
    console.log(text);
  }
}

// parseDuration reads "1500ms", "5s", "2m", "1h" into milliseconds.
function parseDuration(s: string): number {
  const m = /^(\d+(?:\.\d+)?)(ms|s|m|h)$/.exec(s.trim());
  if (!m) throw new Error(`bad duration ${JSON.stringify(s)} (want e.g. 500ms, 5s, 2m)`);
  const unit = { ms: 1, s: 1e3, m: 60e3, h: 3600e3 }[m[2] as "ms" | "s" | "m" | "h"];
  return Math.round(Number(m[1]) * unit);
}

const ms = (ts: Timestamp | undefined): number | undefined => (ts ? timestampMs(ts) : undefined);

// grpcCode is the gRPC name of a Connect code: ResourceExhausted -> RESOURCE_EXHAUSTED.
const grpcCode = (c: Code): string => Code[c].replace(/([a-z])([A-Z])/g, "$1_$2").toUpperCase();

// errorDetails reads the google.rpc details that the server put in grpc-status-details-bin
// (Connect decodes the google.rpc.Status and keeps each detail as an Any: its type name
// and bytes). RetryInfo {Duration retry_delay = 1} and ErrorInfo {string reason = 1;
// string domain = 2} are read with protobuf-es's wire reader.
// A status may carry several ErrorInfos: the first is the cause (SHED_DEADLINE_SLACK, ...);
// curfew's servers append DEPENDENCY_FAILED to a relayed RESOURCE_EXHAUSTED or UNAVAILABLE.
function errorDetails(err: ConnectError): { retryDelayMs?: number; reasons: string[]; domain?: string } {
  const d: { retryDelayMs?: number; reasons: string[]; domain?: string } = { reasons: [] };
  for (const detail of err.details) {
    if (!("type" in detail)) continue; // an IncomingDetail: type name and bytes
    const r = new BinaryReader(detail.value);
    while (r.pos < r.len) {
      const [field, wire] = r.tag();
      if (detail.type === "google.rpc.RetryInfo" && field === 1 && wire === WireType.LengthDelimited) {
        const delay = fromBinary(DurationSchema, r.bytes());
        d.retryDelayMs = Number(delay.seconds) * 1000 + Math.round(delay.nanos / 1e6);
      } else if (detail.type === "google.rpc.ErrorInfo" && field === 1 && wire === WireType.LengthDelimited) {
        d.reasons.push(r.string());
      } else if (detail.type === "google.rpc.ErrorInfo" && field === 2 && wire === WireType.LengthDelimited) {
        d.domain = r.string();
      } else {
        r.skip(wire);
      }
    }
  }
  return d;
}

// fail prints a call's error with its code and curfew's details, and returns exit code 1.
function fail(err: unknown): number {
  const e = ConnectError.from(err);
  const d = errorDetails(e);
  const extra = [d.reasons.length > 0 && `reason ${d.reasons.join(", ")}`, d.retryDelayMs !== undefined && `retry in ${d.retryDelayMs} ms`]
    .filter(Boolean)
    .join(", ");
  out(
    "error",
    { code: grpcCode(e.code), message: e.rawMessage, retry_delay_ms: d.retryDelayMs, reasons: d.reasons, domain: d.domain },
    `error: ${grpcCode(e.code)}: ${e.rawMessage}${extra ? ` (${extra})` : ""}`,
  );
  return 1;
}

// headers are the curfew metadata of one logical call.
function headers(extra: Record<string, string> = {}): Record<string, string> {
  const h: Record<string, string> = { [H.retryId]: randomUUID(), [H.attempt]: "1", ...extra };
  if (flags.tenant) h[H.tenant] = flags.tenant;
  // The orchestrator takes callers from outside the mesh only with an API key; never
  // from a flag, which other users could read in the process list.
  const key = process.env.CURFEW_API_KEY;
  if (key) h["authorization"] = `Bearer ${key}`;
  return h;
}

// unary makes a unary call, retried the way docs/api.md says is safe: UNAVAILABLE, and
// RESOURCE_EXHAUSTED only with a RetryInfo delay, at most 3 attempts, with one retry-id
// and a numbered curfew-attempt, never past the deadline.
async function unary<T>(call: (h: Record<string, string>, timeoutMs: number) => Promise<T>, h: Record<string, string>, timeoutMs = 10_000): Promise<T> {
  const deadline = Date.now() + timeoutMs;
  for (let attempt = 1; ; attempt++) {
    const left = deadline - Date.now();
    try {
      return await call({ ...h, [H.attempt]: String(attempt), [H.deadline]: String(deadline) }, left);
    } catch (err) {
      const e = ConnectError.from(err);
      const { retryDelayMs } = errorDetails(e);
      const retryable = e.code === Code.Unavailable || (e.code === Code.ResourceExhausted && retryDelayMs !== undefined);
      const wait = retryDelayMs ?? Math.random() * Math.min(250, 25 * 2 ** attempt); // full jitter
      if (!retryable || attempt >= 3 || Date.now() + wait + 10 > deadline) throw err;
      await new Promise((r) => setTimeout(r, wait));
    }
  }
}

function task(): string {
  if (flags.plan) return readFileSync(flags.plan, "utf8");
  if (flags.task) return flags.task;
  throw new Error("--plan FILE or --task TEXT is required");
}

const lastStatus = new Map<string, NodeStatus>();

// printNode prints a node event; as text, only when the node's status changed.
function printNode(n: Node): void {
  const changed = lastStatus.get(n.id) !== n.status;
  lastStatus.set(n.id, n.status);
  out(
    "node",
    { id: n.id, kind: NodeKind[n.kind], status: NodeStatus[n.status], tokens: Number(n.tokens) },
    changed ? `  ${n.id.padEnd(28)} ${NodeStatus[n.status].padEnd(18)} ${n.tokens} tokens` : "",
  );
}

function printSummary(r: Run): void {
  const nodes = r.nodes.map((n) => ({
    id: n.id,
    kind: NodeKind[n.kind],
    status: NodeStatus[n.status],
    cause: CancelCause[n.cause],
    tokens: Number(n.tokens),
    tokens_after_cancel: Number(n.tokensAfterCancel),
  }));
  const text = [
    `run ${r.runId}: ${RunStatus[r.status].replace("RUN_STATUS_", "")}` +
      (r.cause ? ` (${CancelCause[r.cause]})` : "") +
      `, ${r.tokens} tokens, ${r.tokensAfterCancel} after the cancel`,
    ...(r.errorCode ? [`  ${r.errorCode}: ${r.errorMessage}`] : []),
    `  ${"NODE".padEnd(28)} ${"KIND".padEnd(20)} ${"STATUS".padEnd(26)} TOKENS AFTER`,
    ...nodes.map((n) => `  ${n.id.padEnd(28)} ${n.kind.padEnd(20)} ${n.status.padEnd(26)} ${String(n.tokens).padStart(6)} ${n.tokens_after_cancel}`),
  ].join("\n");
  out(
    "summary",
    {
      run_id: r.runId,
      status: RunStatus[r.status],
      cause: CancelCause[r.cause],
      deadline_ms: ms(r.deadline),
      ended_at_ms: ms(r.endedAt),
      cancelled_at_ms: ms(r.cancelledAt),
      error_code: r.errorCode,
      tokens: Number(r.tokens),
      tokens_after_cancel: Number(r.tokensAfterCancel),
      nodes,
    },
    text,
  );
}

// summary waits (up to 30 s) for the run to end and returns it.
async function summary(c: Orchestrator, runId: string): Promise<Run> {
  const until = Date.now() + 30_000;
  for (;;) {
    const { run } = await unary((h, t) => c.getRun({ runId }, { headers: h, timeoutMs: t }), headers());
    if (!run) throw new Error("GetRun returned no run");
    if (run.status !== RunStatus.RUNNING || Date.now() > until) return run;
    await new Promise((r) => setTimeout(r, 50));
  }
}

// run streams a run under a deadline. Ctrl-C (SIGINT) aborts the call, which resets the
// HTTP/2 stream: the orchestrator cancels the run (cause client_disconnect), and the
// summary, fetched with GetRun once the tree has stopped, shows the frozen token counts.
async function run(c: Orchestrator): Promise<number> {
  const timeoutMs = parseDuration(flags.deadline ?? "30s");
  const abort = new AbortController();
  let cancelledAt: number | undefined;
  process.once("SIGINT", () => {
    cancelledAt = Date.now();
    out("cancel", { at_ms: cancelledAt }, "^C: cancelling the run");
    abort.abort();
  });
  const deadline = Date.now() + timeoutMs;
  const h = headers({ [H.deadline]: String(deadline) });
  if (flags.criticality) h[H.criticality] = flags.criticality;
  let runId = "";
  let finished: Run | undefined;
  try {
    // timeoutMs becomes grpc-timeout (the authoritative, relative deadline), and
    // curfew-deadline carries the same instant as absolute Unix ms.
    const stream = c.run({ task: task(), model: flags.model ?? "" }, { headers: h, timeoutMs, signal: abort.signal });
    for await (const ev of stream) {
      switch (ev.event.case) {
        case "started":
          runId = ev.event.value.runId;
          out(
            "started",
            { run_id: runId, deadline_ms: ms(ev.event.value.deadline), client_deadline_ms: deadline },
            `run ${runId}, deadline ${new Date(ms(ev.event.value.deadline) ?? 0).toISOString()}`,
          );
          break;
        case "node":
          printNode(ev.event.value);
          break;
        case "finished":
          finished = ev.event.value;
          break;
      }
    }
  } catch (err) {
    const e = ConnectError.from(err);
    if (runId === "" || (cancelledAt === undefined && e.code !== Code.DeadlineExceeded && !finished)) {
      return fail(err);
    }
    out("ended", { code: grpcCode(e.code), message: e.rawMessage }, `call ended: ${grpcCode(e.code)}: ${e.rawMessage}`);
  }
  const r = finished ?? (await summary(c, runId));
  printSummary(r);
  return r.status === RunStatus.SUCCEEDED ? 0 : 1;
}

// start starts a detached run; with --key a retried or repeated start returns the same run.
async function start(c: Orchestrator): Promise<number> {
  const h = headers();
  const req = {
    task: task(),
    model: flags.model ?? "",
    idempotencyKey: flags.key ?? "",
    timeout: flags.timeout ? create(DurationSchema, { seconds: BigInt(Math.floor(parseDuration(flags.timeout) / 1000)) }) : undefined,
  };
  const res = await unary((hh, t) => c.startRun(req, { headers: hh, timeoutMs: t }), h);
  const r = res.run!;
  out(
    "started",
    { run_id: r.runId, created: res.created, deadline_ms: ms(r.deadline), idempotency_key: r.idempotencyKey },
    `run ${r.runId} ${res.created ? "started" : "already started with this key"}, deadline ${new Date(ms(r.deadline) ?? 0).toISOString()}`,
  );
  return 0;
}

async function main(): Promise<number> {
  const [cmd, arg] = positionals;
  const addr = flags.addr ?? process.env.CURFEW_ADDR ?? "127.0.0.1:7700";
  // With the mesh CA: TLS to a mesh that runs mTLS (curfew up without --insecure); the
  // server's certificate carries 127.0.0.1, ::1 and localhost, so the usual host name check
  // holds. Without it: plaintext (curfew up --insecure).
  const ca = flags.ca ?? process.env.CURFEW_CA;
  const transport = ca
    ? createGrpcTransport({
        baseUrl: addr.includes("://") ? addr.replace(/^http:/, "https:") : `https://${addr}`,
        nodeOptions: { ca: readFileSync(ca) },
      })
    : createGrpcTransport({ baseUrl: addr.includes("://") ? addr : `http://${addr}` });
  const c = createClient(OrchestratorService, transport);
  try {
    switch (cmd) {
      case "run":
        return await run(c);
      case "start":
        return await start(c);
      case "get":
        if (!arg) break;
        printSummary(await summary(c, arg));
        return 0;
      case "cancel": {
        if (!arg) break;
        const { run: r } = await unary(
          (h, t) => c.cancelRun({ runId: arg, reason: flags.reason ?? "" }, { headers: h, timeoutMs: t }),
          headers(),
          30_000,
        );
        printSummary(r!);
        return 0;
      }
    }
  } catch (err) {
    if (err instanceof ConnectError) return fail(err);
    console.error(`curfew-node: ${err instanceof Error ? err.message : String(err)}`);
    return 2;
  }
  console.error(usage);
  return 2;
}

// Exit explicitly: the HTTP/2 session would otherwise keep the process alive while idle.
process.exit(await main());
