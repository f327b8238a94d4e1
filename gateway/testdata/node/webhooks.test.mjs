// Verifies kvgate's webhook signatures with the reference Standard Webhooks
// verifier (the npm `standardwebhooks` package), unchanged, as a receiver
// would.
//
// gateway/webhook's TestStandardWebhooksNode writes the messages Go signed
// to a JSON file and runs this file with `node --test`, setting
// KVGATE_WEBHOOK_CASES to the file's path. Each message:
//
//   name       what it shows
//   id         the webhook-id header
//   timestamp  the webhook-timestamp header (Unix seconds, as a string)
//   signature  the webhook-signature header Go's Sign produced
//   body       the exact body bytes, base64
//   verifiesWith  indexes into `secrets` that must verify the message; every
//              other secret must refuse it (all of them, for a tampered
//              body or a stale timestamp)
//   reason     for a message no secret verifies: the refusal expected

import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { test } from 'node:test';

import { Webhook, WebhookVerificationError } from 'standardwebhooks';

const path = process.env.KVGATE_WEBHOOK_CASES;
if (!path) {
  throw new Error('KVGATE_WEBHOOK_CASES is not set; see the comment at the top of webhooks.test.mjs');
}
const { secrets, messages } = JSON.parse(readFileSync(path, 'utf8'));

test('the case file has secrets and messages', () => {
  assert.ok(secrets.length >= 3, 'at least two rotated secrets and one stranger');
  assert.ok(messages.length >= 8);
  assert.ok(messages.some((m) => m.verifiesWith.length === 2), 'a message signed during rotation');
  assert.ok(messages.some((m) => m.verifiesWith.length === 0), 'a message that must be refused');
});

for (const m of messages) {
  test(m.name, () => {
    const body = Buffer.from(m.body, 'base64');
    const headers = {
      'webhook-id': m.id,
      'webhook-timestamp': m.timestamp,
      'webhook-signature': m.signature,
    };
    secrets.forEach((secret, i) => {
      const wh = new Webhook(secret);
      if (m.verifiesWith.includes(i)) {
        const payload = wh.verify(body, headers);
        assert.deepEqual(payload, JSON.parse(body.toString('utf8')), `secret ${i}: the verified payload is the body`);
      } else {
        assert.throws(
          () => wh.verify(body, headers),
          (err) => err instanceof WebhookVerificationError && (!m.reason || err.message.includes(m.reason)),
          `secret ${i} must refuse ${m.name}`,
        );
      }
    });
  });
}
