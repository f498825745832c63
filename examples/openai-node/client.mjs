// Drives curfew's OpenAI-compatible API (docs/openai.md) with the official openai SDK,
// as e2e/openai_node_test.go asks, and prints one JSON line of what happened.
//
//   node client.mjs complete|stream|badkey|nokey|abort|abort-complete|retry-key
//
// Env: CURFEW_OPENAI_URL (http://127.0.0.1:7708/v1), CURFEW_API_KEY, CURFEW_PLAN (a sim
// plan: the user message), CURFEW_ABORT_AFTER_MS (abort, abort-complete, retry-key: when
// to abort the request, from its start; default: abort at the first chunk),
// CURFEW_IDEMPOTENCY_KEY (retry-key).
import OpenAI from "openai";

const mode = process.argv[2];
const client = new OpenAI({
  baseURL: process.env.CURFEW_OPENAI_URL ?? "http://127.0.0.1:7708/v1",
  // The SDK refuses to start without a key: nokey gives it one and removes the header.
  apiKey: process.env.CURFEW_API_KEY || "unused",
  defaultHeaders: mode === "nokey" ? { Authorization: null } : undefined,
  maxRetries: 2, // the server's x-should-retry: false must stop them
});
const abortAfter = process.env.CURFEW_ABORT_AFTER_MS ? Number(process.env.CURFEW_ABORT_AFTER_MS) : null;
const isAbort = (e) => e instanceof OpenAI.APIUserAbortError || e.name === "AbortError";
const plan = process.env.CURFEW_PLAN ?? '{"steps": [{"answer_tokens": 5}]}';
const request = { model: "sim", messages: [{ role: "user", content: plan }] };
const out = (o) => console.log(JSON.stringify(o));

switch (mode) {
  case "complete": {
    const c = await client.chat.completions.create(request);
    out({ id: c.id, content: c.choices[0].message.content, finish_reason: c.choices[0].finish_reason, usage: c.usage });
    break;
  }
  case "stream": {
    const s = await client.chat.completions.create({ ...request, stream: true, stream_options: { include_usage: true } });
    let id = "", content = "", deltas = 0, usage = null, usageLast = false;
    for await (const chunk of s) {
      id = chunk.id;
      usageLast = false;
      for (const ch of chunk.choices) {
        if (ch.delta?.content) {
          deltas++;
          content += ch.delta.content;
        }
      }
      if (chunk.usage) {
        usage = chunk.usage;
        usageLast = true;
      }
    }
    out({ id, content, deltas, usage, usage_last: usageLast });
    break;
  }
  case "nokey":
  case "badkey": {
    try {
      await client.chat.completions.create(request);
      out({ error: null });
    } catch (e) {
      out({ error: e.constructor.name, status: e.status, authentication_error: e instanceof OpenAI.AuthenticationError, message: e.message,
        type: e.type, code: e.code });
    }
    break;
  }
  case "abort": {
    // Starts a streamed completion, aborts it after its first chunk (or after
    // CURFEW_ABORT_AFTER_MS), and prints the run id.
    const ac = new AbortController();
    if (abortAfter !== null) setTimeout(() => ac.abort(), abortAfter);
    const s = await client.chat.completions.create({ ...request, stream: true }, { signal: ac.signal });
    let id = "";
    try {
      for await (const chunk of s) {
        id = chunk.id;
        if (abortAfter === null) ac.abort();
      }
    } catch (e) {
      if (!isAbort(e)) throw e;
    }
    out({ id, aborted: ac.signal.aborted });
    break;
  }
  case "abort-complete": {
    // Starts a non-streamed completion and aborts it after CURFEW_ABORT_AFTER_MS.
    const ac = new AbortController();
    setTimeout(() => ac.abort(), abortAfter ?? 1000);
    let answered = false;
    try {
      await client.chat.completions.create(request, { signal: ac.signal });
      answered = true;
    } catch (e) {
      if (!isAbort(e)) throw e;
    }
    out({ aborted: ac.signal.aborted, answered });
    break;
  }
  case "retry-key": {
    // Sends a completion with CURFEW_IDEMPOTENCY_KEY, aborts it after
    // CURFEW_ABORT_AFTER_MS (a client whose connection broke), then sends it again with
    // the same key, and prints the second answer.
    const headers = { "Idempotency-Key": process.env.CURFEW_IDEMPOTENCY_KEY };
    const ac = new AbortController();
    setTimeout(() => ac.abort(), abortAfter ?? 500);
    let firstAnswered = false;
    try {
      await client.chat.completions.create(request, { signal: ac.signal, headers });
      firstAnswered = true;
    } catch (e) {
      if (!isAbort(e)) throw e;
    }
    const c = await client.chat.completions.create(request, { headers });
    out({ first_answered: firstAnswered, id: c.id, content: c.choices[0].message.content });
    break;
  }
  default:
    console.error("usage: node client.mjs complete|stream|badkey|nokey|abort|abort-complete|retry-key");
    process.exit(2);
}
