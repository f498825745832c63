#!/usr/bin/env node
// curfew-node-tool: a team's tools served to curfew from Node.js, as the gRPC service
// curfew.tool.v1.ToolService (proto/curfew/tool/v1/tool.proto).
//
//   node dist/server.js [--listen HOST:PORT]     (else $CURFEW_TOOL_LISTEN, else 127.0.0.1:7800)
//
// It serves plaintext HTTP/2 (h2c) with Connect's gRPC protocol, which is plain gRPC to
// toolrunner. Tools:
//
//   time_left  the milliseconds left until the call's deadline as this server sees it
//              (grpc-timeout, and curfew-deadline against its own clock) and the curfew
//              metadata it received
//   wait       reports progress every 100 ms until the call is cancelled or max_ms passed
//
// It prints one JSON object per line on stdout: {"event":"listening","address":...} once
// it listens, {"event":"call",...} as each call begins and {"event":"cancelled",...} the
// instant a call's AbortSignal fires (toolrunner cancelled the node: RST_STREAM, or the
// deadline passed), with at_ms, the wall clock in Unix ms. Tests and operators read them.
import * as http2 from "node:http2";
import { parseArgs } from "node:util";
import { setTimeout as sleep } from "node:timers/promises";

import { create } from "@bufbuild/protobuf";
import { Code, ConnectError, type ConnectRouter, type HandlerContext } from "@connectrpc/connect";
import { connectNodeAdapter } from "@connectrpc/connect-node";

import { ProgressSchema } from "./gen/curfew/mesh/v1/mesh_pb.js";
import {
  CallToolResponseSchema,
  CallToolResultSchema,
  SideEffects,
  ToolService,
  type CallToolRequest,
  type CallToolResponse,
} from "./gen/curfew/tool/v1/tool_pb.js";

// The metadata toolrunner sends with every call (mesh/md in the Go code; docs/api.md).
const H = {
  deadline: "curfew-deadline", // the run's absolute deadline, Unix ms, beside grpc-timeout
  runId: "curfew-run-id",
  nodeId: "curfew-node-id", // the tool's node: its path in the run tree
  retryId: "curfew-retry-id", // the logical call, the same on every attempt
  attempt: "curfew-attempt", // 1, 2, ...
  idempotencyKey: "curfew-idempotency-key", // do an irreversible effect at most once per key
} as const;

function emit(event: Record<string, unknown>): void {
  process.stdout.write(JSON.stringify({ ...event, at_ms: Date.now() }) + "\n");
}

// curfew's facts about the call, from its request headers.
function curfewMeta(ctx: HandlerContext): Record<string, string> {
  const meta: Record<string, string> = {};
  for (const [key, header] of Object.entries(H)) {
    const v = ctx.requestHeader.get(header);
    if (v !== null) meta[key] = v;
  }
  return meta;
}

// A tool: its description for ListTools and its handler, an async generator of progress
// events that returns the output (or a tool failure, { error }).
interface Tool {
  description: string;
  inputSchema: object;
  sideEffects: SideEffects;
  run(
    args: Record<string, unknown>,
    ctx: HandlerContext,
    progress: (done: number, total: number, message: string) => CallToolResponse,
  ): AsyncGenerator<CallToolResponse, { output?: unknown; error?: string }>;
}

const tools: Record<string, Tool> = {
  time_left: {
    description: "Returns the milliseconds left until the call's deadline and the curfew metadata the server received.",
    inputSchema: { type: "object", properties: {} },
    sideEffects: SideEffects.NONE,
    async *run(_args, ctx) {
      const now = Date.now();
      const deadline = Number(ctx.requestHeader.get(H.deadline) ?? NaN);
      return {
        output: {
          // From grpc-timeout: what gRPC will hold the call to.
          time_left_ms: ctx.timeoutMs() ?? null,
          // From curfew-deadline, against this server's clock (they differ by the skew).
          deadline_left_ms: Number.isFinite(deadline) ? deadline - now : null,
          metadata: curfewMeta(ctx),
        },
      };
    },
  },
  wait: {
    description: "Waits until cancelled or max_ms passed, reporting progress every 100 ms.",
    inputSchema: {
      type: "object",
      properties: { max_ms: { type: "integer", minimum: 1, description: "the longest wait; default 60000" } },
    },
    sideEffects: SideEffects.NONE,
    async *run(args, ctx, progress) {
      const maxMs = args.max_ms ?? 60000;
      if (typeof maxMs !== "number" || !(maxMs > 0)) {
        return { error: `max_ms must be a positive number, got ${JSON.stringify(maxMs)}` };
      }
      const started = Date.now();
      let ticks = 0;
      while (Date.now() - started < maxMs) {
        try {
          await sleep(100, undefined, { signal: ctx.signal });
        } catch {
          return {}; // cancelled: the listener below has said so; nobody reads a result
        }
        ticks++;
        yield progress(ticks, 0, `waited ${ticks * 100} ms`);
      }
      return { output: { waited_ms: Date.now() - started } };
    },
  },
};

function routes(router: ConnectRouter): void {
  router.service(ToolService, {
    async listTools() {
      return {
        tools: Object.entries(tools).map(([name, t]) => ({
          name,
          description: t.description,
          inputSchemaJson: JSON.stringify(t.inputSchema),
          sideEffects: t.sideEffects,
        })),
      };
    },

    async *callTool(req: CallToolRequest, ctx: HandlerContext) {
      const tool = Object.hasOwn(tools, req.name) ? tools[req.name] : undefined;
      if (tool === undefined) {
        throw new ConnectError(`tool "${req.name}": no such tool on this server`, Code.NotFound);
      }
      let args: unknown = {};
      try {
        if (req.argumentsJson.trim() !== "") args = JSON.parse(req.argumentsJson);
      } catch {
        args = undefined;
      }
      if (typeof args !== "object" || args === null || Array.isArray(args)) {
        throw new ConnectError(`arguments_json of tool "${req.name}": not a JSON object`, Code.InvalidArgument);
      }
      const meta = curfewMeta(ctx);
      emit({ event: "call", tool: req.name, ...meta, time_left_ms: ctx.timeoutMs() ?? null });
      // The instant the call ends for the caller: RST_STREAM (a cancelled node) or the
      // deadline. The handler sees the same signal.
      const onAbort = () => emit({ event: "cancelled", tool: req.name, ...meta, reason: String(ctx.signal.reason) });
      ctx.signal.addEventListener("abort", onAbort, { once: true });
      try {
        const progress = (done: number, total: number, message: string) =>
          create(CallToolResponseSchema, {
            event: { case: "progress", value: create(ProgressSchema, { progress: done, total, message }) },
          });
        const it = tool.run(args as Record<string, unknown>, ctx, progress);
        for (;;) {
          const step = await it.next();
          if (!step.done) {
            yield step.value;
            continue;
          }
          if (ctx.signal.aborted) return;
          const r = step.value;
          const result =
            r.error !== undefined
              ? create(CallToolResultSchema, { isError: true, errorText: r.error })
              : create(CallToolResultSchema, { outputJson: JSON.stringify(r.output ?? null) });
          yield create(CallToolResponseSchema, { event: { case: "result", value: result } });
          return;
        }
      } finally {
        ctx.signal.removeEventListener("abort", onAbort);
      }
    },
  });
}

function main(): void {
  const { values } = parseArgs({ options: { listen: { type: "string" } } });
  const listen = values.listen ?? process.env.CURFEW_TOOL_LISTEN ?? "127.0.0.1:7800";
  const i = listen.lastIndexOf(":");
  const host = listen.slice(0, i).replace(/^\[|\]$/g, "");
  const port = Number(listen.slice(i + 1));
  if (i < 0 || !Number.isInteger(port) || port < 0 || port > 65535) {
    process.stderr.write(`curfew-node-tool: --listen ${JSON.stringify(listen)}: want HOST:PORT\n`);
    process.exit(2);
  }
  const server = http2.createServer(connectNodeAdapter({ routes }));
  server.listen(port, host, () => {
    const addr = server.address();
    if (addr !== null && typeof addr === "object") {
      const h = addr.family === "IPv6" ? `[${addr.address}]` : addr.address;
      emit({ event: "listening", address: `${h}:${addr.port}` });
    }
  });
  const stop = () => server.close(() => process.exit(0));
  process.once("SIGTERM", stop);
  process.once("SIGINT", stop);
}

main();
