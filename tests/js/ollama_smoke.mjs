// The `ollama` npm client against a running mlxd (its URL is argv[2]): list, show, chat whole and
// streamed, generate streamed, embed, ps, and an unknown model. Prints one JSON summary line.
import { Ollama } from 'ollama'

const ollama = new Ollama({ host: process.argv[2] })
const [model, embedder] = [process.argv[3], process.argv[4]]
const messages = [{ role: 'user', content: 'hello' }]
const options = { temperature: 0, num_predict: 8 }

const listed = await ollama.list()
const shown = await ollama.show({ model: `${model}:latest` })
const whole = await ollama.chat({ model, messages, options })
const parts = []
for await (const part of await ollama.chat({ model, messages, options, stream: true })) parts.push(part)
let generated = ''
for await (const part of await ollama.generate({ model, prompt: 'once', options, stream: true })) generated += part.response
const embedded = embedder ? await ollama.embed({ model: embedder, input: ['a', 'b'] }) : { embeddings: [] }
const running = await ollama.ps()
let unknown = null
try {
  await ollama.chat({ model: 'no-such-model', messages })
} catch (e) {
  unknown = { status: e.status_code, error: e.error }
}
console.log(JSON.stringify({
  names: listed.models.map((m) => m.name),
  capabilities: shown.capabilities,
  whole: { content: whole.message.content, done: whole.done, eval_count: whole.eval_count },
  streamed: { content: parts.map((p) => p.message.content).join(''), last_done: parts.at(-1).done, count: parts.length },
  generated,
  vectors: embedded.embeddings.length,
  running: running.models.map((m) => ({ name: m.name, expires_at: m.expires_at })),
  unknown,
}))
