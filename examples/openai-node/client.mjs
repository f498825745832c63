// Drives curfew's OpenAI-compatible API (docs/openai.md) with the official openai SDK,
// as e2e/openai_node_test.go asks, and prints one JSON line of what happened.
//
//   node client.mjs complete|stream|badkey|abort
//
// Env: CURFEW_OPENAI_URL (http://127.0.0.1:7708/v1), CURFEW_API_KEY, CURFEW_PLAN (a sim
// plan: the user message).
import OpenAI from "openai";

const client = new OpenAI({
  baseURL: process.env.CURFEW_OPENAI_URL ?? "http://127.0.0.1:7708/v1",
  apiKey: process.env.CURFEW_API_KEY ?? "",
  maxRetries: 2, // the server's x-should-retry: false must stop them
});
const plan = process.env.CURFEW_PLAN ?? '{"steps": [{"answer_tokens": 5}]}';
const request = { model: "sim", messages: [{ role: "user", content: plan }] };
const out = (o) => console.log(JSON.stringify(o));

switch (process.argv[2]) {
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
  case "badkey": {
    try {
      await client.chat.completions.create(request);
      out({ error: null });
    } catch (e) {
      out({ error: e.constructor.name, status: e.status, authentication_error: e instanceof OpenAI.AuthenticationError, message: e.message });
    }
    break;
  }
  case "abort": {
    // Starts a streamed completion, aborts it after its first chunk, and prints the run id.
    const ac = new AbortController();
    const s = await client.chat.completions.create({ ...request, stream: true }, { signal: ac.signal });
    let id = "";
    try {
      for await (const chunk of s) {
        id = chunk.id;
        ac.abort();
      }
    } catch (e) {
      if (!(e instanceof OpenAI.APIUserAbortError) && e.name !== "AbortError") throw e;
    }
    out({ id, aborted: ac.signal.aborted });
    break;
  }
  default:
    console.error("usage: node client.mjs complete|stream|badkey|abort");
    process.exit(2);
}
