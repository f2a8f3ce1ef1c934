package pd

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/google/uuid"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/routes"
	"github.com/baton-llm/baton/internal/worker"
)

// Connector modes of a vLLM prefill worker (config.KVConnectorMode names them).
const (
	ModeNixl        = config.ConnectorNixl
	ModeMooncake    = config.ConnectorMooncake
	ModePassthrough = config.ConnectorPassthrough
)

// Handoff outcomes, reported per request in openai.HeaderKVHandoff and baton_pd_kv_handoffs_total.
// The none-* outcomes mean the decode computes the prompt itself; HandoffClass says whether
// that was a handoff that should have happened, one that could not by design, or a failure.
const (
	HandoffNixl         = "nixl"
	HandoffMooncake     = "mooncake"
	HandoffPassthrough  = "passthrough"
	HandoffBootstrap    = "bootstrap" // SGLang-style: the legs meet at the prefill's bootstrap server
	HandoffNoneN        = "none-n>1"
	HandoffNoneMissing  = "none-missing-params"
	HandoffNoneNoEngine = "none-no-engine-id"
	// HandoffNoneBatch: a prompt list; vLLM returns the params of its first prompt only, so no
	// single handoff can serve the batch.
	HandoffNoneBatch = "none-batch"
	// HandoffNoneRoute: the route carries no kv_transfer_params in vLLM (/v1/responses).
	HandoffNoneRoute = "none-unsupported-route"
	// HandoffNoneInvalid: the prefill answered params that are no handoff (its own request tag
	// echoed back: do_remote_decode still true).
	HandoffNoneInvalid = "none-invalid-params"
	// HandoffNoneFailed: the request failed before its decode answered; nothing was handed off.
	HandoffNoneFailed = "none-failed"
	// HandoffRecomputed: the decode was handed the KV, but its own usage says it computed the
	// prompt (consumed.go).
	HandoffRecomputed = "recomputed"
	// HandoffNoneLocalPrefill: the request went to a decode worker alone, by design (the
	// picker in front named no prefill): the decode computes the prompt.
	HandoffNoneLocalPrefill = "none-local-prefill"
	// HandoffNonePrefillWhole: the request went to a prefill worker alone, by design (its
	// decode was saturated, the prefill idle: pd_prefill_serves_whole): the prefill decodes.
	HandoffNonePrefillWhole = "none-prefill-whole"
	HandoffNonePrefix       = "none-"
	DefaultBootstrapPort    = 8998
	keyKVTransferParams     = "kv_transfer_params"
)

// Connector is the effective KV connector of a vLLM prefill worker.
type Connector struct {
	Mode          string // nixl, mooncake or passthrough
	Name          string // the configured connector name, "" when none
	EngineID      string // Mooncake: the configured base engine id; "" when not configured
	BootstrapAddr string // Mooncake: http://host:port of the prefill's bootstrap server
	DPSize        int    // data parallel ranks; 0 or 1 means none
	DPInvalid     bool   // a dp_size label that is not a positive integer: mint nothing
	// Learned are the engine ids by DP rank that the prefill's bootstrap server reported, used
	// when none is configured.
	Learned map[int]string
}

// ConnectorFor returns the connector of prefill worker w; def is the default connector name for
// workers that configure none. Names match vLLM's (NixlConnector, MooncakeConnector, …) or
// their short forms, in any case (config.KVConnectorMode).
func ConnectorFor(w *worker.Worker, def string) Connector {
	c := Connector{Name: cmp.Or(w.KVConnector, def), DPSize: w.DPSize, DPInvalid: w.DPSizeInvalid, EngineID: w.KVEngineID}
	mode, _ := config.KVConnectorMode(c.Name) // validated at startup
	switch mode {
	case config.ConnectorNixl:
		c.Mode = ModeNixl
	case config.ConnectorMooncake:
		c.Mode = ModeMooncake
		port := DefaultBootstrapPort
		if w.BootstrapPort != nil {
			port = *w.BootstrapPort
		}
		c.BootstrapAddr = "http://" + w.BootstrapHost + ":" + strconv.Itoa(port)
		if c.EngineID == "" {
			c.Learned = w.EngineIDs()
			if c.DPSize <= 1 && len(c.Learned) > 1 {
				c.DPSize = len(c.Learned)
			}
		}
	default:
		c.Mode = ModePassthrough
	}
	return c
}

// Compatible reports whether decode can take prefill's KV: vLLM pairs with vLLM and every other
// runtime with any but vLLM; a vLLM prefill with a NIXL or Mooncake connector pairs only with
// decodes of the same connector (NIXL pull with pull, push with push), or of none configured
// (unknown: the engine may well have it); def is the default connector name. An SGLang prefill
// whose engine reports another bootstrap port than the one configured pairs with none: its
// decodes would wait on a bootstrap server where none listens (worker.BootstrapMismatch).
func Compatible(prefill, decode *worker.Worker, def string) bool {
	if (prefill.Runtime() == config.RuntimeVLLM) != (decode.Runtime() == config.RuntimeVLLM) {
		return false // a vLLM handoff and an SGLang rendezvous never meet
	}
	if prefill.BootstrapMismatch() != "" {
		return false
	}
	if prefill.Runtime() != config.RuntimeVLLM {
		return true
	}
	p := ConnectorFor(prefill, def)
	if p.Mode == ModePassthrough {
		return true
	}
	name := cmp.Or(decode.KVConnector, def)
	if name == "" {
		return true
	}
	_, d, _ := config.ResolveKVConnector(name)
	_, pv, _ := config.ResolveKVConnector(p.Name)
	return d == pv // NIXL pull and push engines fail their handshake
}

// engineID returns the engine id to name in a Mooncake handoff for the given DP rank: the
// configured base id ({id}_dp{rank} with DP ranks), else the one the bootstrap server reported
// for the rank; "" when none can be minted (no id, an invalid dp_size, DP ranks without a pinned
// rank).
func (c Connector) engineID(rank int, pinned bool) string {
	switch {
	case c.DPInvalid || (c.DPSize > 1 && !pinned):
		return ""
	case c.EngineID == "":
		return c.Learned[rank] // the id the bootstrap server reported for that rank
	}
	if c.DPSize > 1 {
		return fmt.Sprintf("%s_dp%d", c.EngineID, rank)
	}
	return c.EngineID
}

// String describes the connector for logs and the admin view.
func (c Connector) String() string {
	s := c.Mode
	if c.Mode == ModeMooncake && c.EngineID == "" && len(c.Learned) > 0 {
		s += fmt.Sprintf(" (engine ids %v from the bootstrap server %s)", c.Learned, c.BootstrapAddr)
	} else if c.Mode == ModeMooncake {
		s += fmt.Sprintf(" (engine id %q, bootstrap %s)", c.EngineID, c.BootstrapAddr)
	}
	if c.DPSize > 1 {
		s += fmt.Sprintf(", dp_size %d", c.DPSize)
	}
	if c.DPInvalid {
		s += ", dp_size label invalid: no engine id is minted"
	}
	return s
}

// PrefillProbe builds the prefill leg from the client's body so that it ends after one token,
// by length, not streamed, which is what makes a vLLM connector hand the KV off: stream=false;
// stream_options and min_tokens dropped; n=1 when present; the token cap set to 1 on the route's
// key (max_completion_tokens for chat when the client used it, max_output_tokens for responses,
// else max_tokens); stop and stop_token_ids cleared and ignore_eos=true (an EOS or stop on the
// one token would lose the handoff; /v1/messages names them stop_sequences); store=false for
// responses. tag, when non-nil, becomes
// kv_transfer_params; otherwise a client's kv_transfer_params is removed. Every other byte of
// the client's body is unchanged.
func PrefillProbe(path string, body, tag []byte) ([]byte, error) {
	one := []byte("1")
	sets := []openai.Field{{Key: "stream", Value: []byte("false")}, {Key: "ignore_eos", Value: []byte("true")}}
	dels := []string{"stream_options", "min_tokens", "stop", "stop_token_ids", "stop_sequences"}
	if _, ok := openai.Get(body, "n"); ok {
		sets = append(sets, openai.Field{Key: "n", Value: one})
	}
	route := routes.Of(path)
	capKey := route.Cap
	if capKey == "" {
		capKey = "max_tokens"
	}
	if _, ok := openai.Get(body, route.CapAlt); ok && route.CapAlt != "" {
		sets = append(sets, openai.Field{Key: route.CapAlt, Value: one})
		dels = append(dels, capKey)
	} else {
		sets = append(sets, openai.Field{Key: capKey, Value: one})
	}
	if route.NoStore {
		sets = append(sets, openai.Field{Key: "store", Value: []byte("false")})
	}
	if tag != nil {
		sets = append(sets, openai.Field{Key: keyKVTransferParams, Value: tag})
	} else {
		dels = append(dels, keyKVTransferParams)
	}
	return openai.Edit(body, sets, dels)
}

// nixlTag is the prefill leg's kv_transfer_params for NIXL.
var nixlTag = []byte(`{"do_remote_decode":true,"do_remote_prefill":false}`)

// newTransferID mints a Mooncake transfer id: xfer-<uuid v7>.
func newTransferID() string {
	id, err := uuid.NewV7()
	if err != nil {
		id = uuid.New()
	}
	return "xfer-" + id.String()
}

func mooncakePrefillTag(transferID string) []byte {
	b, _ := json.Marshal(transferID)
	return []byte(`{"do_remote_decode":true,"do_remote_prefill":false,"transfer_id":` + string(b) + `}`)
}

func mooncakeDecodeParams(transferID, engineID, bootstrapAddr string) []byte {
	t, _ := json.Marshal(transferID)
	e, _ := json.Marshal(engineID)
	a, _ := json.Marshal(bootstrapAddr)
	return []byte(`{"do_remote_decode":false,"do_remote_prefill":true,"transfer_id":` + string(t) +
		`,"remote_engine_id":` + string(e) + `,"remote_bootstrap_addr":` + string(a) + `}`)
}

// harvest returns the top-level kv_transfer_params of a prefill response, verbatim, and
// whether they are a handoff at all: absent or null is none; params that still ask for a remote
// decode are the request's own tag echoed back, not what a prefill that kept the KV answers
// (do_remote_decode false, do_remote_prefill true).
func harvest(body []byte) (params []byte, valid bool) {
	raw, ok := openai.Get(body, keyKVTransferParams)
	if !ok || string(bytes.TrimSpace(raw)) == "null" {
		return nil, false
	}
	remoteDecode, ok := openai.DecodedBool(raw, "do_remote_decode") // not an object, or a value not a bool: no handoff
	return raw, ok && !remoteDecode
}

// LearnEngineIDs asks a Mooncake prefill's bootstrap server which engine id each of its DP ranks
// registered (GET /query, as vLLM's own proxy does) and records them on w. It reports how many
// it learned; an engine that restarted under a new id is learned anew by the next call. It reads
// both shapes vLLM releases answer: keyed by DP rank, {"<dp_rank>": {"engine_id", "worker_addr"}},
// and keyed by engine id, {"<engine_id>": {"<dp_rank>": {tp: {pp: addr}}}}
// (vllm/distributed/kv_transfer/kv_connector/v1/mooncake/mooncake_utils.py). That release
// answers 503 until every worker registered: asked again soon (every queryRetry, for up to
// queryPatience), not at the next health probe.
func LearnEngineIDs(ctx context.Context, client *http.Client, w *worker.Worker, def string) (int, error) {
	c := ConnectorFor(w, def)
	if c.Mode != ModeMooncake || c.EngineID != "" {
		return 0, nil
	}
	ctx, cancel := context.WithTimeout(ctx, queryPatience)
	defer cancel()
	for {
		ids, err := queryEngineIDs(ctx, client, c.BootstrapAddr)
		if errors.Is(err, errRegistering) {
			select {
			case <-time.After(queryRetry):
				continue
			case <-ctx.Done():
				return 0, err
			}
		}
		if err != nil {
			return 0, err
		}
		w.SetEngineIDs(ids)
		return len(ids), nil
	}
}

// How long and how often a bootstrap server whose workers are still registering is asked again.
const (
	queryPatience = 10 * time.Second
	queryRetry    = 250 * time.Millisecond
)

// errRegistering is a bootstrap server's 503: its workers are still registering.
var errRegistering = errors.New("the bootstrap server's workers are still registering (503)")

// queryEngineIDs reads one answer of GET addr/query into engine ids by DP rank.
func queryEngineIDs(ctx context.Context, client *http.Client, addr string) (map[int]string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, addr+"/query", nil)
	if err != nil {
		return nil, err
	}
	resp, err := client.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	switch {
	case resp.StatusCode == http.StatusServiceUnavailable:
		return nil, errRegistering
	case resp.StatusCode == http.StatusNotFound || resp.StatusCode == http.StatusMethodNotAllowed:
		return nil, fmt.Errorf("GET %s/query answered %d: %w", addr, resp.StatusCode, ErrNotMooncake)
	case resp.StatusCode != http.StatusOK:
		return nil, fmt.Errorf("GET %s/query answered %d", addr, resp.StatusCode)
	}
	var top map[string]json.RawMessage
	if err := json.NewDecoder(io.LimitReader(resp.Body, 1<<20)).Decode(&top); err != nil {
		return nil, fmt.Errorf("GET %s/query: %w: %v", addr, ErrNotMooncake, err)
	}
	ids, err := parseQuery(top)
	if err != nil {
		return nil, fmt.Errorf("GET %s/query: %w: %v", addr, ErrNotMooncake, err)
	}
	return ids, nil
}

// ErrNotMooncake is a bootstrap address whose answer is not a vLLM Mooncake bootstrap server's:
// another engine's server on the port (SGLang's default is Mooncake's 8998 too), or none.
var ErrNotMooncake = errors.New("not a vLLM Mooncake bootstrap server")

// parseQuery reads a /query answer strictly, in either shape vLLM releases give: keyed by DP
// rank, {"<rank>": {"engine_id": id, "worker_addr": {tp: {pp: "host:port"}}}}, or keyed by
// engine id, {"<id>": {"<rank>": {tp: {pp: "host:port"}}}}. Every entry must be of one shape,
// every rank a number, every address host:port, and the ranks 0..n-1 each once: anything else
// is another server's answer, whose ids must not be trusted.
func parseQuery(top map[string]json.RawMessage) (map[int]string, error) {
	if len(top) == 0 {
		return nil, errors.New("no engine registered")
	}
	ids := map[int]string{}
	add := func(rank, id string) error {
		r, err := strconv.Atoi(rank)
		if err != nil || r < 0 || r > 4095 || strconv.Itoa(r) != rank {
			return fmt.Errorf("%q is no DP rank", rank)
		}
		if _, dup := ids[r]; dup {
			return fmt.Errorf("DP rank %d is registered twice", r)
		}
		ids[r] = id
		return nil
	}
	for k, v := range top {
		var byRank struct {
			EngineID   *string         `json:"engine_id"`
			WorkerAddr json.RawMessage `json:"worker_addr"`
		}
		if json.Unmarshal(v, &byRank) == nil && byRank.EngineID != nil {
			if *byRank.EngineID == "" || !validAddrs(byRank.WorkerAddr) {
				return nil, fmt.Errorf("rank %q: no engine id, or worker_addr is not {tp: {pp: host:port}}", k)
			}
			if err := add(k, *byRank.EngineID); err != nil {
				return nil, err
			}
			continue
		}
		var ranks map[string]json.RawMessage // keyed by engine id: its DP ranks
		if k == "" || json.Unmarshal(v, &ranks) != nil || len(ranks) == 0 {
			return nil, fmt.Errorf("entry %q is neither a rank's nor an engine's", k)
		}
		for r, addrs := range ranks {
			if !validAddrs(addrs) {
				return nil, fmt.Errorf("engine %q rank %q: not {tp: {pp: host:port}}", k, r)
			}
			if err := add(r, k); err != nil {
				return nil, err
			}
		}
	}
	for r := range len(ids) {
		if _, ok := ids[r]; !ok {
			return nil, fmt.Errorf("DP ranks are not 0..%d", len(ids)-1)
		}
	}
	return ids, nil
}

// validAddrs reports whether raw is {tp: {pp: "host:port"}}, at least one address.
func validAddrs(raw json.RawMessage) bool {
	var tps map[string]map[string]string
	if json.Unmarshal(raw, &tps) != nil || len(tps) == 0 {
		return false
	}
	for tp, pps := range tps {
		if _, err := strconv.Atoi(tp); err != nil || len(pps) == 0 {
			return false
		}
		for pp, addr := range pps {
			if _, err := strconv.Atoi(pp); err != nil {
				return false
			}
			if _, _, err := net.SplitHostPort(addr); err != nil {
				return false
			}
		}
	}
	return true
}

// Classes of handoff outcomes (the class label of baton_pd_kv_handoffs_total, the status page).
const (
	ClassHandedOff  = "handed_off" // the decode received the KV (nixl, mooncake, bootstrap, passthrough)
	ClassRecomputed = "recomputed" // a handoff was expected and the decode computed the prompt anyway
	ClassByDesign   = "by_design"  // no single handoff can serve the request (n>1, a batch, a route)
	ClassFailed     = "failed"     // the request failed before its decode answered
)

// HandoffClass is the class of a handoff outcome: the recompute alert and the status page count
// ClassRecomputed only — not the requests that never meant to hand off, nor the failures.
func HandoffClass(outcome string) string {
	switch outcome {
	case HandoffNoneN, HandoffNoneBatch, HandoffNoneRoute, HandoffNoneLocalPrefill, HandoffNonePrefillWhole:
		return ClassByDesign
	case HandoffNoneFailed:
		return ClassFailed
	case HandoffRecomputed, HandoffNoneMissing, HandoffNoneNoEngine, HandoffNoneInvalid:
		return ClassRecomputed
	}
	if strings.HasPrefix(outcome, HandoffNonePrefix) {
		return ClassRecomputed
	}
	return ClassHandedOff
}
