// The Files and Batch APIs driven by the official OpenAI Node SDK.
//
// cmd/kvgate's TestOpenAINodeSDKBatches starts a gateway and runs this file
// with `node --test`; by hand, start one yourself and set:
//
//   KVGATE_URL    base URL of a gateway serving a chat model with its job
//                 store, ending in /v1, started with --api-key KVGATE_KEY=TENANT
//   KVGATE_KEY    that API key
//   KVGATE_OTHER_KEY  a key of another tenant
//   KVGATE_MODEL  the chat model [meta-llama/Llama-3.1-8B-Instruct]

import assert from 'node:assert/strict';
import { describe, test } from 'node:test';

import OpenAI, { toFile, NotFoundError } from 'openai';

function required(name) {
  const v = process.env[name];
  if (!v) throw new Error(`${name} is not set`);
  return v;
}

const client = new OpenAI({ baseURL: required('KVGATE_URL'), apiKey: required('KVGATE_KEY'), maxRetries: 0 });
const other = new OpenAI({ baseURL: required('KVGATE_URL'), apiKey: required('KVGATE_OTHER_KEY'), maxRetries: 0 });
const model = process.env.KVGATE_MODEL || 'meta-llama/Llama-3.1-8B-Instruct';

// Every field the SDK's types declare, with its type ('?' marks the
// optional ones, which OpenAI sends as null until they are set).
const fileFields = {
  id: 'string', bytes: 'number', created_at: 'number', filename: 'string', object: 'string', purpose: 'string',
  status: 'string', expires_at: 'number?', status_details: 'string?',
};
const batchFields = {
  id: 'string', completion_window: 'string', created_at: 'number', endpoint: 'string', input_file_id: 'string',
  object: 'string', status: 'string', cancelled_at: 'number?', cancelling_at: 'number?', completed_at: 'number?',
  error_file_id: 'string?', errors: 'object?', expired_at: 'number?', expires_at: 'number?', failed_at: 'number?',
  finalizing_at: 'number?', in_progress_at: 'number?', metadata: 'object?', model: 'string?', output_file_id: 'string?',
  request_counts: 'object', usage: 'object',
};
const usageFields = { input_tokens: 'number', input_tokens_details: 'object', output_tokens: 'number', output_tokens_details: 'object', total_tokens: 'number' };

function checkFields(what, obj, fields) {
  for (const [k, t] of Object.entries(fields)) {
    assert.ok(k in obj, `${what}: field ${k} is missing: ${JSON.stringify(obj)}`);
    const v = obj[k];
    const type = t.replace('?', '');
    if (t.endsWith('?') && v === null) continue;
    assert.equal(typeof v, type, `${what}.${k} is ${JSON.stringify(v)}, not a ${type}`);
  }
}

function lines(n, body = (i) => ({ model, messages: [{ role: 'user', content: `line ${i}` }], max_tokens: 3 })) {
  let s = '';
  for (let i = 0; i < n; i++) {
    s += JSON.stringify({ custom_id: `req-${i}`, method: 'POST', url: '/v1/chat/completions', body: body(i) }) + '\n';
  }
  return s;
}

async function uploadLines(text, name = 'input.jsonl') {
  return client.files.create({ file: await toFile(Buffer.from(text), name), purpose: 'batch' });
}

async function waitDone(id) {
  for (let i = 0; i < 600; i++) {
    const b = await client.batches.retrieve(id);
    checkFields('batch', b, batchFields);
    if (['completed', 'failed', 'expired', 'cancelled'].includes(b.status)) return b;
    await new Promise((r) => setTimeout(r, 100));
  }
  throw new Error(`batch ${id} did not end`);
}

async function parseFile(id) {
  const resp = await client.files.content(id);
  const text = await resp.text();
  return text.split('\n').filter((l) => l.trim() !== '').map((l) => JSON.parse(l));
}

describe('files', () => {
  test('create, retrieve, list, content, delete; another tenant sees nothing', async () => {
    const text = lines(3);
    const f = await uploadLines(text);
    checkFields('file', f, fileFields);
    assert.equal(f.object, 'file');
    assert.equal(f.purpose, 'batch');
    assert.equal(f.bytes, Buffer.byteLength(text));
    assert.equal(f.filename, 'input.jsonl');
    const got = await client.files.retrieve(f.id);
    checkFields('file', got, fileFields);
    assert.equal(got.id, f.id);
    assert.equal(await (await client.files.content(f.id)).text(), text);
    const ids = [];
    for await (const x of client.files.list({ purpose: 'batch' })) ids.push(x.id);
    assert.ok(ids.includes(f.id));
    await assert.rejects(other.files.retrieve(f.id), NotFoundError);
    const exp = await client.files.create({
      file: await toFile(Buffer.from(text), 'expiring.jsonl'), purpose: 'batch', expires_after: { anchor: 'created_at', seconds: 7200 },
    });
    assert.equal(exp.expires_at - exp.created_at, 7200);
    const del = await client.files.delete(f.id);
    assert.deepEqual(del, { id: f.id, object: 'file', deleted: true });
    await assert.rejects(client.files.retrieve(f.id), NotFoundError);
  });

  test('a batch file that is not .jsonl is a BadRequestError', async () => {
    await assert.rejects(
      client.files.create({ file: await toFile(Buffer.from('{}\n'), 'input.txt'), purpose: 'batch' }),
      (e) => e.status === 400 && e.error?.message?.includes('.jsonl'),
    );
  });
});

describe('batches', () => {
  test('create, retrieve until done, output and error files', async () => {
    const n = 30;
    // Line 5 asks for more than the context: the backend refuses it.
    const f = await uploadLines(lines(n, (i) => ({
      model, messages: [{ role: 'user', content: `line ${i}` }], max_tokens: i === 5 ? 100000000 : 3,
    })));
    const created = await client.batches.create({
      input_file_id: f.id, endpoint: '/v1/chat/completions', completion_window: '24h', metadata: { job: 'sdk' },
    });
    checkFields('batch', created, batchFields);
    assert.equal(created.object, 'batch');
    assert.equal(created.status, 'validating');
    assert.deepEqual(created.metadata, { job: 'sdk' });
    const b = await waitDone(created.id);
    assert.equal(b.status, 'completed');
    assert.deepEqual(b.request_counts, { total: n, completed: n - 1, failed: 1 });
    for (const k of ['in_progress_at', 'finalizing_at', 'completed_at', 'expires_at']) assert.equal(typeof b[k], 'number', k);
    assert.equal(b.model, model);
    checkFields('usage', b.usage, usageFields);
    assert.ok(b.usage.input_tokens > 0 && b.usage.output_tokens > 0);
    const out = await parseFile(b.output_file_id);
    const errs = await parseFile(b.error_file_id);
    assert.equal(out.length, n - 1);
    assert.equal(errs.length, 1);
    const ids = new Set([...out, ...errs].map((l) => l.custom_id));
    assert.equal(ids.size, n);
    for (const l of out) {
      assert.match(l.id, /^batch_req_/);
      assert.equal(l.error, null);
      assert.equal(l.response.status_code, 200);
      assert.equal(typeof l.response.request_id, 'string');
      assert.equal(l.response.body.object, 'chat.completion');
    }
    assert.equal(errs[0].custom_id, 'req-5');
    assert.equal(errs[0].response.status_code, 400);
    assert.equal(typeof errs[0].response.body.error.message, 'string');
    const of = await client.files.retrieve(b.output_file_id);
    checkFields('output file', of, fileFields);
    assert.equal(of.purpose, 'batch_output');
  });

  test('a batch with bad lines fails with errors.data[].line', async () => {
    const text = lines(2) + '{"custom_id":"req-0","method":"POST","url":"/v1/chat/completions","body":{}}\n';
    const f = await uploadLines(text);
    const b = await waitDone((await client.batches.create({ input_file_id: f.id, endpoint: '/v1/chat/completions', completion_window: '24h' })).id);
    assert.equal(b.status, 'failed');
    assert.equal(typeof b.failed_at, 'number');
    assert.equal(b.errors.object, 'list');
    checkFields('batch error', b.errors.data[0], { code: 'string', line: 'number?', message: 'string', param: 'string?' });
    checkFields('request_counts', b.request_counts, { completed: 'number', failed: 'number', total: 'number' });
    assert.equal(b.errors.data[0].line, 3);
    assert.equal(b.errors.data[0].code, 'duplicate_custom_id');
  });

  test('list pages with after and limit; another tenant sees none', async () => {
    const made = [];
    for (let i = 0; i < 3; i++) {
      const f = await uploadLines(lines(1));
      made.push((await client.batches.create({ input_file_id: f.id, endpoint: '/v1/chat/completions', completion_window: '24h' })).id);
    }
    const page = await client.batches.list({ limit: 2 });
    assert.equal(page.data.length, 2);
    assert.equal(page.data[0].id, made[2]);
    assert.ok(page.hasNextPage());
    const next = await page.getNextPage();
    assert.equal(next.data[0].id, made[0]);
    const all = [];
    for await (const b of client.batches.list({ limit: 1 })) {
      checkFields('listed batch', b, batchFields);
      all.push(b.id);
    }
    for (const id of made) assert.ok(all.includes(id), id);
    const theirs = [];
    for await (const b of other.batches.list()) theirs.push(b.id);
    assert.ok(!theirs.some((id) => all.includes(id)));
    await assert.rejects(other.batches.retrieve(made[0]), NotFoundError);
    for (const id of made) await waitDone(id);
  });

  test('cancel: queued lines are cancelled, the rest are in the output file', async () => {
    const n = 1000;
    const f = await uploadLines(lines(n, (i) => ({ model, messages: [{ role: 'user', content: `line ${i}` }], max_tokens: 128 })));
    const b = await client.batches.create({ input_file_id: f.id, endpoint: '/v1/chat/completions', completion_window: '24h' });
    for (let i = 0; i < 100; i++) {
      const r = await client.batches.retrieve(b.id);
      if (r.status === 'in_progress' && r.request_counts.completed > 0) break;
      await new Promise((r) => setTimeout(r, 50));
    }
    const c = await client.batches.cancel(b.id);
    checkFields('cancelled batch', c, batchFields);
    assert.ok(['cancelling', 'cancelled'].includes(c.status), c.status);
    assert.equal(typeof c.cancelling_at, 'number');
    const done = await waitDone(b.id);
    assert.equal(done.status, 'cancelled');
    assert.equal(typeof done.cancelled_at, 'number');
    const out = done.output_file_id ? await parseFile(done.output_file_id) : [];
    const errs = done.error_file_id ? await parseFile(done.error_file_id) : [];
    assert.equal(out.length + errs.length, n);
    assert.ok(errs.length > 0, 'some lines were cancelled');
    assert.ok(errs.every((l) => l.error.code === 'batch_cancelled'));
    assert.equal(new Set([...out, ...errs].map((l) => l.custom_id)).size, n);
  });
});
