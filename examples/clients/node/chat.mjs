// Omni Mesh from Node.js through its OpenAI-compatible API (`omni up --http 8000`,
// or `omni gateway`), with the official `openai` npm package: no .proto files.
//
//   npm ci && node chat.mjs [--base-url http://127.0.0.1:8000/v1] [--model omni-default]
//                          [--max-tokens N] [--temperature T] [--stream] PROMPT
//
// Env: OMNI_TOKEN, the API key: a bearer token the orchestrator knows (any text
// when the mesh has no tokens). With --json the last line of stdout is the
// result as JSON (text, finish_reason, usage; or the error), for scripts.
import { parseArgs } from "node:util";

import OpenAI from "openai";

const { values, positionals } = parseArgs({
  options: {
    "base-url": { type: "string", default: "http://127.0.0.1:8000/v1" },
    model: { type: "string", default: "omni-default" },
    "max-tokens": { type: "string" },
    temperature: { type: "string" },
    stream: { type: "boolean", default: false },
    json: { type: "boolean", default: false },
  },
  allowPositionals: true,
});
const prompt = positionals.join(" ") || "Describe a red apple.";
const client = new OpenAI({
  baseURL: values["base-url"],
  apiKey: process.env.OMNI_TOKEN || "none",
  maxRetries: 0,
});

const request = { model: values.model, messages: [{ role: "user", content: prompt }] };
if (values["max-tokens"] !== undefined) request.max_tokens = Number(values["max-tokens"]);
if (values.temperature !== undefined) request.temperature = Number(values.temperature);

function say(text) {
  if (!values.json) process.stdout.write(text);
}

let result;
try {
  if (values.stream) {
    const stream = await client.chat.completions.create({
      ...request,
      stream: true,
      stream_options: { include_usage: true },
    });
    result = { text: "", chunks: 0, finish_reason: null, usage: null };
    for await (const chunk of stream) {
      if (chunk.usage) result.usage = chunk.usage;
      const choice = chunk.choices[0];
      if (!choice) continue;
      if (choice.delta.content) {
        result.text += choice.delta.content;
        result.chunks += 1;
        say(choice.delta.content);
      }
      if (choice.finish_reason) result.finish_reason = choice.finish_reason;
    }
  } else {
    const reply = await client.chat.completions.create(request);
    const choice = reply.choices[0];
    result = { text: choice.message.content, finish_reason: choice.finish_reason, usage: reply.usage };
    say(result.text);
  }
} catch (err) {
  if (!(err instanceof OpenAI.APIError)) throw err;
  // OpenAI's error shape: the HTTP status, and the request field at fault.
  const error = { status: err.status, message: err.message, param: err.param, code: err.code };
  if (values.json) console.log(JSON.stringify({ error }));
  else console.error(`${err.status}: ${err.message}`);
  process.exit(1);
}
if (values.json) console.log(JSON.stringify(result));
else process.stdout.write("\n");
