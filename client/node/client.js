#!/usr/bin/env node
// Node.js client of the KVBoost inference service: loads the same .proto files as the Python
// code at run time, warms texts, then streams one generation and prints its GenerationResult.
'use strict';

const fs = require('fs');
const path = require('path');
const { parseArgs } = require('util');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const USAGE = `usage: node client.js [options] PROMPT

Warms the given texts, then generates from PROMPT, streaming the text to stdout.

options:
  --address HOST:PORT     inference service (env KVBOOST_ADDRESS, default 127.0.0.1:50051)
  --warm FILE             warm this file's text first (repeatable)
  --warm-text TEXT        warm this text first (repeatable)
  --prefix-file FILE      prepend this file's text to PROMPT (to reuse what --warm stored)
  --system TEXT           send [system, user] chat messages instead of a raw prompt
  --max-new-tokens N      tokens to generate (server default 64)
  --mode MODE             BASELINE, PREFIX_CACHE (exact; the server default unless it opted in) or
                          CHUNK_KV_REUSE (approximate: the result says approximate: true)
  --token TOKEN           bearer token (env KVBOOST_TOKEN)
  --timeout SECONDS       deadline of each call (default 300)
  --proto-dir DIR         folder holding kvboost/v1/*.proto (env KVBOOST_PROTO_DIR, default ../../proto)
  --json                  print only JSON: one WarmResult per warm, then the GenerationResult
`;

function parseOptions(argv) {
  const { values, positionals } = parseArgs({
    args: argv,
    allowPositionals: true,
    options: {
      address: { type: 'string', default: process.env.KVBOOST_ADDRESS || '127.0.0.1:50051' },
      warm: { type: 'string', multiple: true, default: [] },
      'warm-text': { type: 'string', multiple: true, default: [] },
      'prefix-file': { type: 'string' },
      system: { type: 'string' },
      'max-new-tokens': { type: 'string' },
      mode: { type: 'string' },
      token: { type: 'string', default: process.env.KVBOOST_TOKEN || '' },
      timeout: { type: 'string', default: '300' },
      'proto-dir': { type: 'string', default: process.env.KVBOOST_PROTO_DIR || path.join(__dirname, '..', '..', 'proto') },
      json: { type: 'boolean', default: false },
      help: { type: 'boolean', short: 'h', default: false },
    },
  });
  if (values.help || positionals.length !== 1) {
    process.stderr.write(USAGE);
    process.exit(values.help ? 0 : 2);
  }
  return { ...values, prompt: positionals[0] };
}

// keepCase: the objects use the proto field names (output_text, ttft_ms, ...), like the Python client.
function loadService(protoDir, address) {
  const files = ['kvboost/v1/inference.proto', 'kvboost/v1/cache.proto'];
  const definition = protoLoader.loadSync(files, {
    includeDirs: [protoDir], keepCase: true, longs: Number, enums: String, defaults: true, oneofs: true,
  });
  const kvboost = grpc.loadPackageDefinition(definition).kvboost.v1;
  return new kvboost.InferenceService(address, grpc.credentials.createInsecure());
}

function callOptions(options) {
  const metadata = new grpc.Metadata();
  if (options.token) metadata.set('authorization', `Bearer ${options.token}`);
  return [metadata, { deadline: Date.now() + Number(options.timeout) * 1000 }];
}

function warm(client, options, text) {
  return new Promise((resolve, reject) => {
    client.Warm({ text }, ...callOptions(options), (error, result) => (error ? reject(error) : resolve(result)));
  });
}

function generate(client, options, request, onText) {
  return new Promise((resolve, reject) => {
    let result = null;
    const call = client.Generate(request, ...callOptions(options));
    call.on('data', (event) => {
      if (event.text) onText(event.text);
      if (event.result) result = event.result;
    });
    call.on('error', reject);
    call.on('end', () => (result ? resolve(result) : reject(new Error('the stream ended without a result'))));
  });
}

function buildRequest(options) {
  const prefix = options['prefix-file'] ? fs.readFileSync(options['prefix-file'], 'utf8') : '';
  const request = {};
  if (options.system !== undefined) {
    request.messages = [{ role: 'system', content: options.system }, { role: 'user', content: prefix + options.prompt }];
  } else {
    request.prompt = prefix + options.prompt;
  }
  if (options['max-new-tokens']) request.max_new_tokens = Number(options['max-new-tokens']);
  if (options.mode) request.mode = options.mode.toUpperCase();
  return request;
}

async function main() {
  const options = parseOptions(process.argv.slice(2));
  const client = loadService(options['proto-dir'], options.address);
  const texts = [
    ...options.warm.map((file) => ({ name: file, text: fs.readFileSync(file, 'utf8') })),
    ...options['warm-text'].map((text, index) => ({ name: `text ${index + 1}`, text })),
  ];
  for (const { name, text } of texts) {
    const result = await warm(client, options, text);
    if (options.json) console.log(JSON.stringify(result));
    else console.log(`warmed ${name}: ${result.chunks_stored} chunks, ${result.token_count} tokens`);
  }
  const onText = options.json ? () => {} : (text) => process.stdout.write(text);
  const result = await generate(client, options, buildRequest(options), onText);
  if (options.json) {
    console.log(JSON.stringify(result));
  } else {
    process.stdout.write('\n');
    console.log(`result: ${JSON.stringify(result)}`);
  }
  client.close();
}

main().catch((error) => {
  const code = error.code !== undefined ? ` (${grpc.status[error.code]})` : '';
  process.stderr.write(`kvboost-node: error${code}: ${error.details || error.message}\n`);
  process.exit(1);
});
