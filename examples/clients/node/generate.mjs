// Omni Mesh from Node.js: ask the orchestrator one prompt and print what each
// output stage streams back, using the repository's .proto files as they are.
//
//   npm install && node generate.mjs [--address 127.0.0.1:50050] [--max-tokens N]
//       [--image FILE] PROMPT
//
// --image sends a PNG, JPEG, WebP or GIF with the prompt (a ContentPart before the
// text, see ChatMessage in stage.proto). It goes in the one Generate message, so it
// must fit the orchestrator's runtime.max_message_bytes (64 MiB by default);
// larger media go as TensorChunks on GenerateStream, as the Python client sends them.
//
// Env: OMNI_TOKEN (a bearer token), OMNI_CACERT (a CA file: TLS). With --json the
// last line of stdout is the whole result as JSON (status, then per stage its
// token ids and text), for scripts. Speech (a segment's "audio" tensor: float32
// PCM, see AudioFormat in stage.proto) is written as it arrives to
// OUT/<request id>-<stage>.wav (--out, default omni-out), a valid WAV after each piece.
import fs from "node:fs";
import path from "node:path";
import { fileURLToPath } from "node:url";
import { parseArgs } from "node:util";

import grpc from "@grpc/grpc-js";
import protoLoader from "@grpc/proto-loader";

function protosDir() {
  // The protos/ folder of the checkout this file lives in (examples/ may be a link).
  let dir = path.dirname(fs.realpathSync(fileURLToPath(import.meta.url)));
  while (dir !== path.dirname(dir)) {
    if (fs.existsSync(path.join(dir, "protos", "omni", "v1", "orchestrator.proto"))) {
      return path.join(dir, "protos");
    }
    dir = path.dirname(dir);
  }
  throw new Error("cannot find protos/omni/v1/orchestrator.proto above this file");
}

const { values, positionals } = parseArgs({
  options: {
    address: { type: "string", default: "127.0.0.1:50050" },
    "max-tokens": { type: "string" },
    temperature: { type: "string" },
    json: { type: "boolean", default: false },
    out: { type: "string", default: "omni-out" },
    image: { type: "string" },
  },
  allowPositionals: true,
});
const prompt = positionals.join(" ") || "Describe a red apple.";

const definition = protoLoader.loadSync(
  ["omni/v1/orchestrator.proto", "grpc/health/v1/health.proto"],
  // int64 token ids as numbers (they are vocabulary indices); enums by name.
  { includeDirs: [protosDir()], keepCase: true, longs: Number, enums: String, defaults: true, oneofs: true },
);
const loaded = grpc.loadPackageDefinition(definition);
const credentials = process.env.OMNI_CACERT
  ? grpc.credentials.createSsl(fs.readFileSync(process.env.OMNI_CACERT))
  : grpc.credentials.createInsecure();
const orchestrator = new loaded.omni.v1.Orchestrator(values.address, credentials);
const health = new loaded.grpc.health.v1.Health(values.address, credentials);
const metadata = new grpc.Metadata();
if (process.env.OMNI_TOKEN) metadata.set("authorization", `Bearer ${process.env.OMNI_TOKEN}`);

function check(service) {
  return new Promise((resolve, reject) =>
    health.check({ service }, (err, reply) => (err ? reject(err) : resolve(reply.status))),
  );
}

const readiness = await check("omni.v1.Orchestrator");
if (readiness !== "SERVING") {
  console.error(`the orchestrator at ${values.address} is ${readiness}`);
  process.exit(3);
}

const params = {};
if (values["max-tokens"] !== undefined) params.max_tokens = Number(values["max-tokens"]);
if (values.temperature !== undefined) params.temperature = Number(values.temperature);
const IMAGE_TYPES = { ".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg",
  ".webp": "image/webp", ".gif": "image/gif" };
function userMessage() {
  if (values.image === undefined) return { role: "user", content: prompt };
  const media_type = IMAGE_TYPES[path.extname(values.image).toLowerCase()];
  if (!media_type) {
    console.error(`${values.image}: not a PNG, JPEG, WebP or GIF file (by its suffix)`);
    process.exit(2);
  }
  let data;
  try {
    data = fs.readFileSync(values.image);
  } catch (err) {
    console.error(`${values.image}: cannot read it (${err.code ?? err.message})`);
    process.exit(2);
  }
  return { role: "user", parts: [{ image: { media_type, data } }, { text: prompt }] };
}
const request = { inputs: { messages: [userMessage()] }, params };

// A 16-bit PCM WAV header for `bytes` of samples (RIFF sizes rewritten after each piece).
function wavHeader(rate, channels, bytes) {
  const h = Buffer.alloc(44);
  h.write("RIFF", 0); h.writeUInt32LE(36 + bytes, 4); h.write("WAVEfmt ", 8);
  h.writeUInt32LE(16, 16); h.writeUInt16LE(1, 20); h.writeUInt16LE(channels, 22);
  h.writeUInt32LE(rate, 24); h.writeUInt32LE(rate * channels * 2, 28);
  h.writeUInt16LE(channels * 2, 32); h.writeUInt16LE(16, 34);
  h.write("data", 36); h.writeUInt32LE(bytes, 40);
  return h;
}
const wavs = {};
function saveAudio(stage, segment) {
  const tensor = segment.tensors.find((t) => t.name === "audio" && t.dtype === "float32");
  if (!tensor) return;
  const { sample_rate: rate, channels } = segment.audio_format;
  const file = path.join(values.out, `${segment.request_id}-${stage}.wav`);
  const wav = (wavs[file] ??= { fd: null, bytes: 0 });
  if (wav.fd === null) {
    fs.mkdirSync(values.out, { recursive: true });
    wav.fd = fs.openSync(file, "w");
  }
  const raw = tensor.raw; // little-endian float32 in [-1, 1]
  const pcm = Buffer.alloc((raw.length / 4) * 2);
  for (let i = 0; i < raw.length / 4; i++) {
    const x = Math.max(-1, Math.min(1, raw.readFloatLE(i * 4)));
    pcm.writeInt16LE(Math.trunc(x * 32767), i * 2);
  }
  fs.writeSync(wav.fd, pcm, 0, pcm.length, 44 + wav.bytes);
  wav.bytes += pcm.length;
  fs.writeSync(wav.fd, wavHeader(rate, channels || 1, wav.bytes), 0, 44, 0);
}

const stages = {};
let done = null;
const call = orchestrator.generate(request, metadata);
call.on("data", (event) => {
  if (event.kind === "done") {
    done = event.done;
    return;
  }
  if (event.kind !== "segment") return; // progress, completed, tensor chunks
  const stage = (stages[event.stage] ??= { token_ids: [], text: "", segments: 0 });
  stage.token_ids.push(...event.segment.token_ids);
  stage.text += event.segment.text_delta;
  stage.segments += 1;
  saveAudio(event.stage, event.segment);
  if (!values.json && event.segment.text_delta) process.stdout.write(event.segment.text_delta);
});
await new Promise((resolve, reject) => {
  call.on("end", resolve);
  // A failed request ends its RPC with the status its Done reported (after the
  // Done): the Done says it all. A status without a Done is the call's own error.
  call.on("error", (err) => (done !== null && err.code === done.code ? resolve() : reject(err)));
});
if (!values.json) process.stdout.write("\n");
if (done === null) throw new Error("the stream ended without a Done");
if (values.json) console.log(JSON.stringify({ done, stages }));
else if (done.code !== 0) console.error(`${done.code_name}: ${done.message}`);
process.exit(done.code === 0 ? 0 : 1);
