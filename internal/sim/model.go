package sim

import (
	"encoding/binary"
	"hash/fnv"
	"math"
	"strconv"
	"strings"
)

// The fake model. Tokenization and generation are pure functions, so the same request gives the
// same text on any engine, aggregated or disaggregated, and tests can compute the expected text.

// vocab is the output vocabulary; output token id i+1 is vocab[i].
var vocab = strings.Fields(`alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima
mike november oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu amber
basalt cedar dune ember fjord glacier harbor island jasper kelp lagoon meadow nectar orchard
prairie quartz river summit tundra umber valley willow xenon yarrow zephyr atlas beacon comet
drift eclipse falcon granite horizon`)

// maxNatural bounds the length at which the fake model emits EOS by itself.
const maxNatural = 32

// Tokenize turns text into token ids: one token per whitespace-separated word.
func Tokenize(text string) []uint32 {
	words := strings.Fields(text)
	ids := make([]uint32, len(words))
	for i, w := range words {
		ids[i] = wordID(w)
	}
	return ids
}

// vocabID maps an output word to its token id.
var vocabID = func() map[string]uint32 {
	m := make(map[string]uint32, len(vocab))
	for i, v := range vocab {
		m[v] = uint32(i + 1)
	}
	return m
}()

func wordID(w string) uint32 {
	if id, ok := vocabID[w]; ok {
		return id
	}
	// FNV-1a, inline: this runs once per prompt word.
	h := uint32(2166136261)
	for i := 0; i < len(w); i++ {
		h ^= uint32(w[i])
		h *= 16777619
	}
	return 100 + h%32000
}

// Detokenize returns the text of output ids, each token preceded by a space.
func Detokenize(ids []uint32) string {
	var sb strings.Builder
	for _, id := range ids {
		sb.WriteString(TokenText(id))
	}
	return sb.String()
}

// TokenText is the text of one token: a space and its word.
func TokenText(id uint32) string {
	if id >= 1 && int(id) <= len(vocab) {
		return " " + vocab[id-1]
	}
	return " tok" + strconv.FormatUint(uint64(id), 10)
}

// Digest is the fake KV cache of a prompt: a hash of its token ids. A decode engine that
// receives KV checks it against the digest of its own prompt.
func Digest(prompt []uint32) uint64 {
	h := fnv.New64a()
	var b [4]byte
	for _, id := range prompt {
		binary.LittleEndian.PutUint32(b[:], id)
		h.Write(b[:])
	}
	return h.Sum64()
}

func mix(x uint64) uint64 {
	x += 0x9e3779b97f4a7c15
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9
	x = (x ^ (x >> 27)) * 0x94d049bb133111eb
	return x ^ (x >> 31)
}

// Token returns output token i of the answer to the prompt with digest d and seed.
func Token(d, seed uint64, i int) uint32 {
	return uint32(mix(d^mix(seed)+uint64(i)*0x632be59bd9b4e019)%uint64(len(vocab))) + 1
}

// NaturalLength is how many tokens the model generates before EOS when nothing caps it.
//
// One prompt in sixteen ends at once: its first token is EOS, as a real model's can be. A
// prefill probe that does not set ignore_eos then ends by stop, not by length, and the engine
// keeps no KV for a decode: the simulator catches such a probe.
func NaturalLength(d, seed uint64) int {
	if mix(d^mix(seed^0x5e0f))%16 == 0 {
		return 0
	}
	return 1 + int(mix(d^mix(seed^0xe05))%maxNatural)
}

// Sampling is what bounds one generation.
type Sampling struct {
	MaxTokens    int // 0 means no cap: the model stops at EOS
	IgnoreEOS    bool
	Stop         []string // stop words; the matching token is not emitted
	StopTokenIDs []uint32
	Seed         uint64
}

// Finish reasons.
const (
	FinishLength = "length"
	FinishStop   = "stop"
)

// Generate returns the output tokens and finish reason for a prompt digest under s. first, when
// non-nil, is the token the prefill engine produced; generation continues from it.
func Generate(d uint64, s Sampling) ([]uint32, string) {
	natural := NaturalLength(d, s.Seed)
	var out []uint32
	for i := 0; ; i++ {
		if s.MaxTokens > 0 && i >= s.MaxTokens {
			return out, FinishLength
		}
		if !s.IgnoreEOS && i >= natural {
			return out, FinishStop
		}
		if s.MaxTokens <= 0 && s.IgnoreEOS && i >= 4096 {
			return out, FinishLength
		}
		tok := Token(d, s.Seed, i)
		if s.stops(tok) {
			return out, FinishStop
		}
		out = append(out, tok)
	}
}

func (s Sampling) stops(tok uint32) bool {
	for _, id := range s.StopTokenIDs {
		if id == tok {
			return true
		}
	}
	if len(s.Stop) == 0 {
		return false
	}
	w := strings.TrimSpace(TokenText(tok))
	for _, st := range s.Stop {
		if st == w || strings.TrimSpace(st) == w {
			return true
		}
	}
	return false
}

// Logprob is the fake log-probability of token id at position pos.
func Logprob(id uint32, pos int) float64 {
	return -math.Round(float64(mix(uint64(id)<<20|uint64(pos))%500)) / 100
}
