// Package trace reads public LLM request traces — Mooncake's JSONL (the format NVIDIA's AIPerf
// calls mooncake_trace, and AISBench and AgentX read) and Azure's LLM inference CSV — into one
// form, scales them for a smaller fleet, and turns a request's prefix block ids into a prompt:
// the same id always the same text, so that prefix caches, KV events and cache-aware routing see
// the trace's own reuse. What it computes of a trace (its unlimited-memory ceiling) is computed,
// never guessed.
package trace

import (
	"bufio"
	"bytes"
	"encoding/csv"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// BlockTokens is the tokens of one of Mooncake's prefix blocks (its hash_ids are of 512-token
// blocks).
const BlockTokens = 512

// Bounds on what a trace file may hold: a line, a request's lengths and its block ids, the
// requests of a file. Past one, reading fails naming the file and line.
const (
	MaxLineBytes = 1 << 20
	MaxTokens    = 1 << 24
	MaxBlocks    = MaxTokens/BlockTokens + 1
	MaxRequests  = 10_000_000
)

// Request is one request of a trace: when it arrived (from the trace's start), its prompt and
// completion lengths in tokens, and the ids of its prompt's blocks of BlockTokens tokens (equal
// ids are a shared prefix; none where the trace says nothing of prefixes).
type Request struct {
	At             time.Duration
	Input, Output  int
	HashIDs        []int64
	blockTokensOut int // tokens of a block after Scale (0: BlockTokens)
}

// BlockSize is the tokens of one of r's prompt blocks (BlockTokens, or fewer after Scale).
func (r Request) BlockSize() int {
	if r.blockTokensOut > 0 {
		return r.blockTokensOut
	}
	return BlockTokens
}

// ErrFormat is a trace that is no Mooncake JSONL or Azure CSV as published.
var ErrFormat = errors.New("not a trace in a known format")

// Open reads the trace at path: Mooncake JSONL (.jsonl) or Azure CSV (.csv).
func Open(path string) ([]Request, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	name := filepath.Base(path)
	switch strings.ToLower(filepath.Ext(path)) {
	case ".jsonl":
		return ReadMooncake(f, name)
	case ".csv":
		return ReadAzure(f, name)
	}
	return nil, fmt.Errorf("%s: %w (want .jsonl, Mooncake's, or .csv, Azure's)", name, ErrFormat)
}

// lineError is an error naming a trace file's line.
func lineError(name string, line int, format string, args ...any) error {
	return fmt.Errorf("%s:%d: %w: %s", name, line, ErrFormat, fmt.Sprintf(format, args...))
}

// mooncakeLine is one line of Mooncake's trace: all four members, each once.
type mooncakeLine struct {
	Timestamp    *float64 `json:"timestamp"` // ms from the trace's start
	InputLength  *int     `json:"input_length"`
	OutputLength *int     `json:"output_length"`
	HashIDs      *[]int64 `json:"hash_ids"`
}

// ReadMooncake reads Mooncake's JSONL trace (FAST25-release/traces): one JSON object a line,
// timestamp (ms), input_length, output_length and hash_ids. A line that is not one, or whose
// values are out of bounds, is an error naming name and the line; blank lines are passed over.
func ReadMooncake(r io.Reader, name string) ([]Request, error) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), MaxLineBytes)
	var out []Request
	line := 0
	for sc.Scan() {
		line++
		b := bytes.TrimSpace(sc.Bytes())
		if len(b) == 0 {
			continue
		}
		if len(out) >= MaxRequests {
			return nil, lineError(name, line, "more than %d requests", MaxRequests)
		}
		var m mooncakeLine
		dec := json.NewDecoder(bytes.NewReader(b))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&m); err != nil {
			return nil, lineError(name, line, "%v", err)
		}
		if dec.More() {
			return nil, lineError(name, line, "more than one JSON value")
		}
		switch {
		case m.Timestamp == nil || m.InputLength == nil || m.OutputLength == nil || m.HashIDs == nil:
			return nil, lineError(name, line, "want timestamp, input_length, output_length and hash_ids")
		case *m.Timestamp < 0 || math.IsNaN(*m.Timestamp) || *m.Timestamp > float64(1000*time.Hour/time.Millisecond):
			return nil, lineError(name, line, "timestamp %v: want milliseconds from the start, at most 1,000 hours", *m.Timestamp)
		case *m.InputLength < 1 || *m.InputLength > MaxTokens:
			return nil, lineError(name, line, "input_length %d: want 1 to %d", *m.InputLength, MaxTokens)
		case *m.OutputLength < 1 || *m.OutputLength > MaxTokens:
			return nil, lineError(name, line, "output_length %d: want 1 to %d", *m.OutputLength, MaxTokens)
		case len(*m.HashIDs) > (*m.InputLength+BlockTokens-1)/BlockTokens:
			return nil, lineError(name, line, "%d hash_ids for %d tokens: more blocks than the prompt has", len(*m.HashIDs), *m.InputLength)
		}
		for _, id := range *m.HashIDs {
			if id < 0 {
				return nil, lineError(name, line, "hash id %d is negative", id)
			}
		}
		out = append(out, Request{At: time.Duration(*m.Timestamp * float64(time.Millisecond)),
			Input: *m.InputLength, Output: *m.OutputLength, HashIDs: *m.HashIDs})
	}
	if err := sc.Err(); err != nil {
		return nil, lineError(name, line+1, "%v", err)
	}
	return out, nil
}

// azureHeader is Azure's LLM inference trace's header (AzurePublicDataset, data/
// AzureLLMInferenceTrace_*.csv).
var azureHeader = []string{"TIMESTAMP", "ContextTokens", "GeneratedTokens"}

// azureTime is the layout of Azure's timestamps: 2023-11-16 18:15:46.6805900.
const azureTime = "2006-01-02 15:04:05.9999999"

// ReadAzure reads Azure's LLM inference CSV: TIMESTAMP, ContextTokens, GeneratedTokens; the
// times are made relative to the first request's. It carries no prefixes: its requests have no
// hash ids. A row that is not one is an error naming name and the line.
func ReadAzure(r io.Reader, name string) ([]Request, error) {
	cr := csv.NewReader(io.LimitReader(r, int64(MaxRequests)*64))
	cr.FieldsPerRecord = len(azureHeader)
	cr.ReuseRecord = true
	head, err := cr.Read()
	if err != nil {
		return nil, lineError(name, 1, "%v", err)
	}
	for i, h := range azureHeader {
		if strings.TrimPrefix(head[i], "\ufeff") != h {
			return nil, lineError(name, 1, "header %q: want %s", strings.Join(head, ","), strings.Join(azureHeader, ","))
		}
	}
	var out []Request
	var start time.Time
	for line := 2; ; line++ {
		rec, err := cr.Read()
		if err == io.EOF {
			return out, nil
		}
		if err != nil {
			return nil, lineError(name, line, "%v", err)
		}
		if len(out) >= MaxRequests {
			return nil, lineError(name, line, "more than %d requests", MaxRequests)
		}
		at, err := time.Parse(azureTime, rec[0])
		if err != nil {
			return nil, lineError(name, line, "TIMESTAMP %q: want %s", rec[0], azureTime)
		}
		in, err1 := strconv.Atoi(rec[1])
		outTok, err2 := strconv.Atoi(rec[2])
		switch {
		case err1 != nil || in < 1 || in > MaxTokens:
			return nil, lineError(name, line, "ContextTokens %q: want 1 to %d", rec[1], MaxTokens)
		case err2 != nil || outTok < 0 || outTok > MaxTokens:
			return nil, lineError(name, line, "GeneratedTokens %q: want 0 to %d", rec[2], MaxTokens)
		}
		if len(out) == 0 {
			start = at
		}
		d := at.Sub(start)
		if d < 0 {
			return nil, lineError(name, line, "TIMESTAMP %s is before the first request's", rec[0])
		}
		out = append(out, Request{At: d, Input: in, Output: max(outTok, 1)})
	}
}

// Scaling is how a trace is fitted to a smaller fleet: Compress divides its times (8: eight
// times as fast; 0 or 1: as recorded); TokenScale divides its lengths and its blocks (8: a block
// of 512 tokens becomes one of 64, its reuse kept); Limit keeps its first requests (0: all).
type Scaling struct {
	Compress   float64
	TokenScale int
	Limit      int
}

// Scale returns reqs fitted by s (a new slice; reqs is not changed).
func Scale(reqs []Request, s Scaling) []Request {
	if s.Limit > 0 && s.Limit < len(reqs) {
		reqs = reqs[:s.Limit]
	}
	out := make([]Request, len(reqs))
	div := max(s.TokenScale, 1)
	for i, r := range reqs {
		if s.Compress > 1 {
			r.At = time.Duration(float64(r.At) / s.Compress)
		}
		r.Input, r.Output = max(r.Input/div, 1), max(r.Output/div, 1)
		r.blockTokensOut = max(BlockTokens/div, 1)
		out[i] = r
	}
	return out
}

// Ceiling is the share of the trace's prompt blocks a prefix cache of unlimited memory finds:
// those whose id an earlier request already had. No router and no fleet can find more.
func Ceiling(reqs []Request) float64 {
	seen := map[int64]struct{}{}
	total, reused := 0, 0
	for _, r := range reqs {
		for _, id := range r.HashIDs {
			total++
			if _, ok := seen[id]; ok {
				reused++
			}
		}
		for _, id := range r.HashIDs {
			seen[id] = struct{}{}
		}
	}
	if total == 0 {
		return 0
	}
	return float64(reused) / float64(total)
}

// Prompt is r's prompt as words the simulated engines count one token each: each of its blocks
// the text of its hash id (the same id always the same words, whatever request holds it), then
// words of the request's own for the tokens its blocks do not cover. seed separates the
// unshared tail of requests of equal ids and lengths (the request's index in the trace).
func Prompt(r Request, seed int) string {
	var b strings.Builder
	bs := r.BlockSize()
	tokens := 0
	for _, id := range r.HashIDs {
		n := min(bs, r.Input-tokens) // the last block may be short
		if n <= 0 {
			break
		}
		for k := 0; k < n; k++ {
			fmt.Fprintf(&b, "b%dw%d ", id, k)
		}
		tokens += n
	}
	for k := tokens; k < r.Input; k++ {
		fmt.Fprintf(&b, "r%dw%d ", seed, k)
	}
	return strings.TrimSuffix(b.String(), " ")
}

// Oracle is the share of the trace's prompt blocks found cached by an all-knowing router over
// engines prefix caches of blocks blocks each, evicted least recently used: each request goes to
// the engine holding the longest prefix of its blocks (ties to the engine that served fewest),
// and a block is found only as part of such a prefix, as an engine's prefix cache finds it. It
// is what routing can reach with the fleet's memory, beside Ceiling's unlimited one.
func Oracle(reqs []Request, engines, blocks int) float64 {
	if engines < 1 || blocks < 1 {
		return 0
	}
	caches := make([]*lru, engines)
	served := make([]int, engines)
	for i := range caches {
		caches[i] = newLRU(blocks)
	}
	total, found := 0, 0
	for _, r := range reqs {
		best, bestMatch := 0, -1
		for e, c := range caches {
			m := c.prefix(r.HashIDs)
			if m > bestMatch || m == bestMatch && served[e] < served[best] {
				best, bestMatch = e, m
			}
		}
		total += len(r.HashIDs)
		found += bestMatch
		served[best]++
		for _, id := range r.HashIDs {
			caches[best].touch(id)
		}
	}
	if total == 0 {
		return 0
	}
	return float64(found) / float64(total)
}

// lru is a prefix cache of block ids, evicted least recently used.
type lru struct {
	max   int
	clock int64
	at    map[int64]int64 // id -> its last use
	order map[int64]int64 // last use -> id (uses are unique)
	old   int64           // no use before it is still held
}

func newLRU(n int) *lru {
	return &lru{max: n, at: map[int64]int64{}, order: map[int64]int64{}}
}

// prefix is how many of ids, from the first, the cache holds.
func (c *lru) prefix(ids []int64) int {
	for i, id := range ids {
		if _, ok := c.at[id]; !ok {
			return i
		}
	}
	return len(ids)
}

// touch makes id the most recently used, evicting the least recently used past the bound.
func (c *lru) touch(id int64) {
	c.clock++
	if t, ok := c.at[id]; ok {
		delete(c.order, t)
	}
	c.at[id], c.order[c.clock] = c.clock, id
	for len(c.at) > c.max {
		for ; ; c.old++ {
			if victim, ok := c.order[c.old]; ok {
				delete(c.order, c.old)
				delete(c.at, victim)
				break
			}
		}
	}
}
