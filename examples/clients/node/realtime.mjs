// A spoken turn over Omni Mesh's Realtime API (`omni up --http 8000`, or `omni
// gateway`) with the official `openai` npm package's WebSocket client: a text
// message in, the answer's transcript and 16-bit PCM (24 kHz mono) out.
//
//   npm ci && node realtime.mjs [--base-url http://127.0.0.1:8000/v1] [--model omni-default]
//                              [--voice alloy] [--max-tokens N] [--out answer.pcm] PROMPT
//
// Env: OMNI_TOKEN, the API key (any text when the mesh has no tokens). With --json
// the last line of stdout is the result as JSON (status, transcript, audio bytes
// and their sha256; or the error), for scripts.
import { createHash } from "node:crypto";
import { writeFileSync } from "node:fs";
import { connect } from "node:net";
import { parseArgs } from "node:util";

import OpenAI from "openai";
import { OpenAIRealtimeWS } from "openai/realtime/ws";

const { values, positionals } = parseArgs({
  options: {
    "base-url": { type: "string", default: "http://127.0.0.1:8000/v1" },
    model: { type: "string", default: "omni-default" },
    voice: { type: "string", default: "alloy" },
    "max-tokens": { type: "string" },
    out: { type: "string" },
    json: { type: "boolean", default: false },
  },
  allowPositionals: true,
});
const prompt = positionals.join(" ") || "Describe a red apple.";
const client = new OpenAI({ baseURL: values["base-url"], apiKey: process.env.OMNI_TOKEN || "none" });
// The package always dials wss://. A gateway served over plain HTTP (`omni up
// --http` on this machine) is reached by handing `ws` a plain TCP connection.
const plain = new URL(values["base-url"]).protocol === "http:";
const options = plain ? { createConnection: (at) => connect(at) } : undefined;
const session = await OpenAIRealtimeWS.create(client, { model: values.model, options });

const audio = [];
let transcript = "";
const result = await new Promise((resolve) => {
  session.socket.on("open", () => {
    const settings = { type: "realtime", audio: { output: { voice: values.voice } } };
    if (values["max-tokens"] !== undefined) settings.max_output_tokens = Number(values["max-tokens"]);
    session.send({ type: "session.update", session: settings });
    session.send({
      type: "conversation.item.create",
      item: { type: "message", role: "user", content: [{ type: "input_text", text: prompt }] },
    });
    session.send({ type: "response.create" });
  });
  session.on("response.output_audio_transcript.delta", (event) => {
    transcript += event.delta;
    if (!values.json) process.stdout.write(event.delta);
  });
  session.on("response.output_audio.delta", (event) => audio.push(Buffer.from(event.delta, "base64")));
  session.on("response.done", (event) => {
    const pcm = Buffer.concat(audio);
    if (values.out) writeFileSync(values.out, pcm);
    resolve({
      status: event.response.status,
      transcript,
      audio_bytes: pcm.length,
      audio_sha256: createHash("sha256").update(pcm).digest("hex"),
      usage: event.response.usage,
    });
  });
  session.on("error", (err) => resolve({ error: err.error ?? { message: err.message } }));
});
session.close();
if (values.json) console.log(JSON.stringify(result));
else console.log(result.error ? `\nerror: ${result.error.message}` : `\n(${result.audio_bytes} bytes of audio)`);
process.exitCode = result.error ? 1 : 0;
