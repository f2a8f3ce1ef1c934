package director

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/pd"
	"github.com/baton-llm/baton/internal/policy"
	"github.com/baton-llm/baton/internal/record"
	"github.com/baton-llm/baton/internal/routes"
	"github.com/baton-llm/baton/internal/tenant"
)

// Tenancy is who may call and how much: the tenants (swapped whole by a reload) and the limiter
// that counts their use.
type Tenancy struct {
	// Set returns the tenants now; nil: --api-key's tenant alone (or everyone's, without one).
	Set     func() *tenant.Set
	Limiter *tenant.Limiter
	// MaxTokens is the completion tokens reserved for a request without max_tokens, and the
	// most reserved for one with it.
	MaxTokens int
	// PromptTokens, when set, gives a prompt's token count when the engines' tokenizer answer
	// for it is cached (cache_aware asked for it already); else the prompt is estimated.
	PromptTokens func(model, path string, body []byte) (int, bool)
	// TrustHeader, when set, is a header a trusted proxy in front sets to the tenant's name: a
	// request carrying it is that tenant's (401 for a name no tenant has), whatever its key.
	TrustHeader string
	// CountPrompt, when set, asks the worker at workerURL for the token count of a prompt (its
	// /tokenize): a request that ended without the engine's usage is charged the engine's own
	// count of the prompt it computed, not an estimate from the body's bytes.
	CountPrompt func(ctx context.Context, workerURL, model, path string, body []byte) (int, bool)
	// AskPrompt, when set, asks a worker serving model for the token count of a prompt before
	// the request is sent (its /tokenize): the default cap written under a token limit is the
	// model's context less that count. False when no engine could count it whole.
	AskPrompt func(ctx context.Context, model, path string, body []byte) (int, bool)
}

// countPromptTimeout bounds the ask for a prompt's token count when a request is settled.
const countPromptTimeout = 2 * time.Second

// Tenancy is who may call and how much.
func (d *Director) Tenancy() Tenancy { return d.o.Tenancy }

// Tenants returns the tenant set now.
func (d *Director) Tenants() *tenant.Set { return d.o.Tenancy.Set() }

// DefaultTenancy is the tenancy of a server given none: --api-key names tenant default, and
// without it every request is tenant default; nothing is limited.
func DefaultTenancy(apiKey string) Tenancy {
	cfg := config.Default()
	cfg.ClientAPIKey = apiKey
	set, err := tenant.Build(cfg, os.Getenv)
	if err != nil {
		panic("director: the default tenants: " + err.Error())
	}
	return Tenancy{Set: func() *tenant.Set { return set }, Limiter: tenant.NewLimiter(nil), MaxTokens: 1024}
}

// Identify names a request's tenant from its Authorization values (auth) and the values of the
// trusted tenant header (trusted; read only where no tenant has a key): more than one
// Authorization header is refused (which one would count is ambiguous); a key no tenant has is
// 401, the same answer whatever tenants exist. key says the request carried Baton's key (or was
// named by the trusted header): it is Baton's, to be removed before the request goes on. who is
// nil for a fleet of one unbounded tenant (nothing to name or count: the hot path).
func (d *Director) Identify(auth, trusted []string) (who *tenant.Tenant, key bool, e *openai.Error) {
	if len(auth) > 1 {
		return nil, false, &openai.Error{Status: statusBadRequest, Code: openai.CodeDuplicateHeader,
			Message: "the request has more than one Authorization header"}
	}
	set := d.Tenants()
	if h := d.o.Tenancy.TrustHeader; h != "" && set.Open() && len(trusted) > 0 {
		if who = set.ByName(trusted[0]); len(trusted) > 1 || who == nil {
			return nil, false, &openai.Error{Status: statusUnauthorized, Code: openai.CodeInvalidAPIKey,
				Message: fmt.Sprintf("the %s header names no tenant (one header, a configured tenant's name)", h)}
		}
		return who, true, nil
	}
	if set.Open() {
		if who = set.Identify(""); len(who.Rules()) == 0 && len(who.Models()) == 0 {
			return nil, false, nil // one tenant, unbounded: nothing to name or count (the hot path stays as it was)
		}
		return who, false, nil
	}
	var k string
	if len(auth) == 1 {
		if b, ok := cutBearer(auth[0]); ok {
			k = b
		}
	}
	if who = set.Identify(k); who == nil {
		return nil, false, &openai.Error{Status: statusUnauthorized, Code: openai.CodeInvalidAPIKey,
			Message: "missing or invalid API key: send 'Authorization: Bearer <key>'"}
	}
	return who, true, nil
}

// cutBearer returns the key of "Bearer KEY" (the scheme in any case).
func cutBearer(h string) (string, bool) {
	if len(h) < 7 || !strings.EqualFold(h[:7], "bearer ") {
		return "", false
	}
	return h[7:], true
}

// lease is a request's reservation against its tenant's limits, settled when it ends.
type lease struct {
	ls [2]*tenant.Lease // one per rule that holds (RulesFor's order), nil where none
	// The prompt and completion tokens it was reserved: what a request that ended without the
	// engine's usage is charged from (record.Charge).
	estimate, completion int
	// counted: estimate is the engines' own count (a cached /tokenize answer), not the body's
	// bytes / 4.
	counted bool
	// ask is what Baton asked the engine of the stream's usage beyond what the client did
	// (proxy.Orders).
	ask usageAsk
	req *pd.Request
}

// admitTenant checks the request against its tenant: a model the tenant may not use is 404
// model_not_found, the answer of a model nobody serves (a tenant cannot learn another's
// models); past a limit it is 429 with Retry-After and nothing is dispatched. Under a token
// limit the completion reserved is the request's own (completionBudget): a request that could
// not fit in the tenant's whole bucket is refused at once, and one naming no cap gets the
// default written into its body. An admitted request of a limited tenant carries OpenAI's
// rate-limit headers, and, streamed without usage asked for, asks the engine for it (the relay
// keeps the usage event from the client). The lease returned is settled by settleTenant.
func (d *Director) admitTenant(ctx context.Context, rec *record.Record, preq *pd.Request, est *tokenEstimate) (ls *lease, shown tenant.Decision, refusal *openai.Error, ok bool) {
	req, path := preq.Request, preq.Path
	t := rec.Who
	if t == nil {
		return nil, shown, nil, true
	}
	if req.Model == "" && !t.Allows(req.Model) {
		// SGLang's /generate names no model; a tenant held to some models must name one.
		return nil, shown, &openai.Error{Status: statusBadRequest, Code: openai.CodeModelRequired, Param: "model",
			Message: `this key may use only some models: name one in "model" (on /generate too)`}, false
	}
	if !t.Allows(req.Model) {
		return nil, shown, SelectionError(&policy.NoWorkerError{Role: config.RoleRegular, Model: req.Model, Unserved: true}).Answer, false
	}
	rules := t.RulesFor(req.Model)
	if rules[0] == nil && rules[1] == nil {
		// Nothing to limit, but the tenant's tokens are counted (baton_tenant_tokens_total): a
		// stream not asking for usage asks the engine for it, the relay keeping it from the client.
		if req.Stream && routes.Of(path).StreamOptions {
			if body, ask := askUsage(req.Body, false); ask.include && req.SetBody(body) == nil {
				return &lease{ask: ask}, shown, nil, true
			}
		}
		return nil, shown, nil, true
	}
	// The token budget is judged against the tightest token limit among the request's rules.
	var tight *tenant.Rule
	for _, r := range rules {
		if r != nil && r.TPM > 0 && (tight == nil || r.TPM < tight.TPM) {
			tight = r
		}
	}
	if tight != nil {
		if e := d.budget(ctx, preq, est, tight, t.Name); e != nil {
			if e.Status == statusTooManyRequests { // the limit refused it; a 400 is a malformed request
				d.metrics.TenantRejections.WithLabelValues(t.Name, tenant.ReasonTokens).Inc()
			}
			return nil, shown, e, false
		}
	}
	prompt, completion := est.get()
	reserved := prompt + completion
	// Every rule holds: the model's and the tenant's. A refusal by one gives back what the
	// others took.
	var leases [2]*tenant.Lease
	shownSet := false
	undo := func() {
		for _, l := range leases {
			d.o.Tenancy.Limiter.Cancel(l)
		}
	}
	for i, rule := range rules {
		if rule == nil {
			continue
		}
		l, dec, err := d.o.Tenancy.Limiter.Reserve(ctx, rule, reserved)
		if errors.Is(err, tenant.ErrStoreUnavailable) {
			undo()
			d.metrics.TenantRejections.WithLabelValues(t.Name, "store_unavailable").Inc()
			return nil, tenant.Decision{}, &openai.Error{Status: statusUnavailable, Code: openai.CodeRateLimitStoreUnavailable, RetryAfter: "1",
				Message: "the store that counts tenants' limits cannot be reached; retry shortly"}, false
		}
		if l == nil {
			undo()
			return nil, dec, d.refuseTenant(t.Name, rule, dec, reserved), false
		}
		leases[i] = l
		if !shownSet {
			shown, shownSet = dec, true // the most specific rule's windows go in the headers
		}
	}
	l := &lease{ls: leases, estimate: prompt, completion: completion, counted: est.counted, req: preq}
	rec.Reserved = true
	if req.Stream {
		rec.ByStreamUsage = true
		if tight != nil && routes.Of(path).StreamOptions {
			// Under a token limit the engine reports the completion on every event, so that a
			// stream cut short is charged what was generated, however many tokens an event
			// carried and whatever they were (reasoning, tool-call arguments).
			if body, ask := askUsage(req.Body, true); (ask.include || ask.each) && req.SetBody(body) == nil {
				l.ask = ask
			}
		}
	}
	return l, shown, nil, true
}

// refuseTenant is the answer to a request one of its tenant's rules refused (d says why).
func (dr *Director) refuseTenant(name string, rule *tenant.Rule, d tenant.Decision, reserved int) *openai.Error {
	dr.metrics.TenantRejections.WithLabelValues(name, d.Reason).Inc()
	e := &openai.Error{Status: statusTooManyRequests, Code: openai.CodeTenantRateLimit,
		RetryAfter: strconv.Itoa(int(math.Ceil(max(d.RetryAfter, time.Second).Seconds())))}
	of := "its limit"
	if rule.Model != "" {
		of = "its limit for " + rule.Model
	}
	switch d.Reason {
	case tenant.ReasonConcurrency:
		e.Code = openai.CodeTenantConcurrency
		e.Message = fmt.Sprintf("tenant %s has %d requests in flight, %s (max_concurrent)", name, d.MaxConc, of)
	case tenant.ReasonRequests:
		e.Message = fmt.Sprintf("tenant %s reached %s of %d requests per minute", name, of, d.Requests.Limit)
	default:
		e.Message = fmt.Sprintf("tenant %s reached %s of %d tokens per minute (this request is reserved about %d)", name, of, d.Tokens.Limit, reserved)
	}
	return e
}

// budget bounds a request of a tenant under a token limit by what its reservation covers: the
// completion reserved is the request's own cap (completionBudget) times its prompts and
// samples, uncapped; a request naming no cap gets a default written into the body the engines
// get (defaultCap), so that none generates more than was reserved. A request that could not fit
// in the tenant's whole bucket (its completion alone, or with its prompt) is refused: 429 naming
// the field, with x-should-retry false (OpenAI's SDKs do not retry it) and no Retry-After —
// waiting cannot help it.
func (d *Director) budget(ctx context.Context, preq *pd.Request, est *tokenEstimate, rule *tenant.Rule, name string) *openai.Error {
	req, path := preq.Request, preq.Path
	const lower = "is spelled in another letter case than the engines' field: spell it in lower case"
	// A cap or count Baton cannot read as an integer: an engine may still read it (pydantic
	// takes "100" and 1e5 as integers) while a smaller one beside it is all Baton reserved.
	const integer = "must be a non-negative integer"
	if k := req.Misspelled(budgetKeys...); k != "" {
		return badField(k, lower)
	}
	if sp, ok := req.Get("sampling_params"); ok {
		if k := openai.Misspelled(sp, "max_new_tokens", "n"); k != "" {
			return badField("sampling_params."+k, lower)
		}
		if v, ok := openai.Get(sp, "n"); ok {
			if _, valid := capValue(v); !valid {
				return badField("sampling_params.n", integer)
			}
		}
	}
	if v, ok := req.Get("best_of"); ok {
		if _, valid := capValue(v); !valid {
			return badField("best_of", integer)
		}
	}
	b := completionBudget(req, path, d.o.Tenancy.MaxTokens)
	switch {
	case b.invalid:
		return badField(b.field, integer)
	case b.missing && b.required:
		return badField(b.field, "is required on "+path)
	case b.missing:
		if e := d.defaultCap(ctx, preq, est, rule, name, &b); e != nil {
			return e
		}
		body, err := writeBudget(req.Body, path, b)
		if err != nil || req.SetBody(body) != nil {
			return badField(b.field, "could not be set on this request: give it")
		}
	}
	copies := max(1, preq.Batch) * max(1, preq.Samples)
	est.completion, est.budgeted = min(b.tokens, math.MaxInt32)*copies, true
	prompt, completion := est.get()
	e := &openai.Error{Status: statusTooManyRequests, Code: openai.CodeTenantRequestTooLarge, Param: b.field, NoRetry: true}
	switch {
	case completion > rule.TPM:
		e.Message = fmt.Sprintf("%s %d (× %d prompts and samples) asks more tokens than tenant %s's whole limit of %d tokens per minute: lower %s",
			b.field, b.tokens, copies, name, rule.TPM, b.field)
	case prompt+completion > rule.TPM:
		e.Message = fmt.Sprintf("this request needs about %d tokens (a prompt of about %d and %s %d), more than tenant %s's whole limit of %d tokens per minute: shorten the prompt or lower %s",
			prompt+completion, prompt, b.field, completion, name, rule.TPM, b.field)
	default:
		return nil
	}
	return e
}

// badField is the 400 invalid_request of a request member that says what is wrong with it.
func badField(field, what string) *openai.Error {
	return &openai.Error{Status: statusBadRequest, Code: openai.CodeInvalidRequest, Param: field, Message: field + " " + what}
}

// defaultCap sets b, the cap of a request naming none, to what the engines would generate
// without one. On chat and responses vLLM, SGLang and OpenAI generate to the end of the
// model's context: the default is the model's context length (contextLen) less the prompt —
// the engines' own count of it (cached, else asked of a worker serving the model), else its
// bytes, a bound no tokenizer exceeds — when that, times the request's samples, fits the
// tenant's whole bucket beside the prompt; otherwise the request is refused, 400 naming the
// cap: the client must send one that fits (a shorter default would cut its answers silently).
// Where no worker reports the model's context length, the default is the route's
// (completionBudget: tenant_max_tokens_estimate), no more than the bucket holds beside the
// prompt. /v1/completions and /generate keep the engines' own defaults (16, 128).
func (d *Director) defaultCap(ctx context.Context, preq *pd.Request, est *tokenEstimate, rule *tenant.Rule, name string, b *budgetOf) *openai.Error {
	req, path := preq.Request, preq.Path
	copies := max(1, preq.Batch) * max(1, preq.Samples)
	window, known := 0, false
	if b.toContext {
		window, known = d.contextLen(req.Model)
	}
	prompt, _ := est.get()
	if !known {
		// A small bucket gets shorter answers, not a refusal of every request.
		if fit := (rule.TPM - prompt) / copies; fit >= 1 && fit < b.tokens {
			b.tokens = fit
		}
		return nil
	}
	if !est.counted {
		if f := d.o.Tenancy.AskPrompt; f != nil {
			if n, ok := f(ctx, req.Model, path, req.Body); ok && n > 0 {
				est.prompt, est.counted = n, true
			}
		}
	}
	if !est.counted {
		prompt = promptBytes(path, req.Body)
	} else {
		prompt = est.prompt
	}
	room := window - prompt
	e := &openai.Error{Status: statusBadRequest, Code: openai.CodeInvalidRequest, Param: b.field}
	switch fit := (rule.TPM - prompt) / copies; {
	case room < 1:
		e.Message = fmt.Sprintf("%s is required here: the prompt (about %d tokens) leaves no room in %s's context of %d tokens",
			b.field, prompt, req.Model, window)
	case room*copies+prompt > rule.TPM && fit < 1:
		e.Message = fmt.Sprintf("%s is required here: this request names no cap, and its prompt (about %d tokens) leaves no room in tenant %s's whole limit of %d tokens per minute",
			b.field, prompt, name, rule.TPM)
	case room*copies+prompt > rule.TPM:
		e.Message = fmt.Sprintf("%s is required here: without it the engine may generate to the end of %s's context, %d tokens beside the prompt (about %d), more than tenant %s's whole limit of %d tokens per minute holds; send %s of at most %d",
			b.field, req.Model, room, prompt, name, rule.TPM, b.field, fit)
	default:
		b.tokens = room
		return nil
	}
	return e
}

// tokenEstimate is a request's prompt and completion tokens before it is served, worked out the
// first time something needs it (a tenant's limit, a full fleet's queue): the prompt's count
// when the engines' tokenizer answer for it is cached, else its body's bytes / 4; the
// completion's max_tokens (capped) times its prompts and samples, or — budgeted, under a
// tenant's token limit — the request's own budget.
type tokenEstimate struct {
	d                       *Director
	preq                    *pd.Request
	done, budgeted, counted bool
	prompt, completion      int
}

func (e *tokenEstimate) get() (prompt, completion int) {
	if !e.done {
		req, path := e.preq.Request, e.preq.Path
		e.prompt = (len(req.Body) + 3) / 4
		if f := e.d.o.Tenancy.PromptTokens; f != nil {
			if n, ok := f(req.Model, path, req.Body); ok {
				e.prompt, e.counted = n, true
			}
		}
		if !e.budgeted {
			limit := e.d.o.Tenancy.MaxTokens
			c := limit
			if b := completionBudget(req, path, limit); !b.invalid {
				c = min(b.tokens, limit)
			}
			e.completion = c * max(1, e.preq.Batch) * max(1, e.preq.Samples)
		}
		e.done = true
	}
	return e.prompt, e.completion
}

// budgetKeys are the top-level members a request's reservation is worked out from: an engine
// reading one of them in another letter case would generate more than was reserved.
var budgetKeys = []string{"max_completion_tokens", "max_tokens", "max_output_tokens", "n", "best_of", "sampling_params"}

// capKeys are the members that cap a request's completion, on every route: the largest present
// is the request's budget (an engine reading another of them generates no more than it).
var capKeys = []string{"max_completion_tokens", "max_tokens", "max_output_tokens"}

// A budgetOf is the completion tokens a request may generate per prompt and sample, and the
// member that says so.
type budgetOf struct {
	tokens int
	field  string
	// missing: the request names no cap, and tokens is the default to write (writeBudget);
	// required: the route's protocol makes the cap required (Anthropic's messages); invalid:
	// field holds something other than a non-negative integer (or null).
	missing, required, invalid bool
	// toContext: missing on a route whose engines generate to the end of the model's context
	// without a cap (chat, responses), tokens being the fallback where that is not known.
	toContext bool
}

// listBudget is the completion of SGLang's list-form sampling_params (one per prompt): the
// largest max_new_tokens any names. Every entry must name one — Baton writes no cap into a list
// — and each must be an integer, as its n must.
func listBudget(raw []byte) budgetOf {
	var each []map[string]json.RawMessage
	if json.Unmarshal(raw, &each) != nil {
		return budgetOf{field: "sampling_params", invalid: true}
	}
	b := budgetOf{tokens: 0, field: "sampling_params.max_new_tokens"}
	for i, p := range each {
		at := fmt.Sprintf("sampling_params[%d]", i)
		if v, ok := p["n"]; ok {
			if _, valid := capValue(v); !valid {
				return budgetOf{field: at + ".n", invalid: true}
			}
		}
		v, ok := p["max_new_tokens"]
		if !ok {
			return budgetOf{field: at + ".max_new_tokens", missing: true, required: true}
		}
		n, valid := capValue(v)
		switch {
		case !valid:
			return budgetOf{field: at + ".max_new_tokens", invalid: true}
		case n < 0: // null: the engine's default, which Baton cannot write into a list
			return budgetOf{field: at + ".max_new_tokens", missing: true, required: true}
		}
		b.tokens = max(b.tokens, n)
	}
	return b
}

// completionBudget is the completion a request asks for per prompt and sample: the largest of
// its caps (or, on SGLang's /generate, sampling_params.max_new_tokens). Without one: on
// /v1/completions OpenAI's default of 16, on /generate SGLang's default of 128 (its
// docs/backend/sampling_params.md), elsewhere def — to be written into the body, so that the
// engine is held to it.
func completionBudget(req *openai.Request, path string, def int) budgetOf {
	if path == "/generate" {
		const field = "sampling_params.max_new_tokens"
		if raw, ok := req.Get("sampling_params"); ok && len(raw) > 0 && raw[0] == '[' {
			return listBudget(raw)
		}
		if raw, ok := req.Get("sampling_params"); ok {
			if v, ok := openai.Get(raw, "max_new_tokens"); ok {
				n, valid := capValue(v)
				switch {
				case !valid:
					return budgetOf{field: field, invalid: true}
				case n >= 0:
					return budgetOf{tokens: n, field: field}
				}
			}
		}
		return budgetOf{tokens: 128, field: field, missing: true}
	}
	b := budgetOf{tokens: -1}
	null := false // a cap given as null: no cap at all, not the route's default
	for _, key := range capKeys {
		if raw, ok := req.Get(key); ok {
			n, valid := capValueLax(raw)
			if !valid {
				return budgetOf{field: key, invalid: true}
			}
			null = null || n < 0
			if n > b.tokens {
				b.tokens, b.field = n, key
			}
		}
	}
	if b.tokens >= 0 {
		return b
	}
	b = budgetOf{tokens: def, field: routes.Of(path).Cap, missing: true}
	switch path {
	case "/v1/completions":
		b.tokens = 16
		if null { // vLLM's null: to the context's end (get_max_tokens, vllm/entrypoints/utils.py; its 16 is for absent)
			b.tokens, b.toContext = def, true
		}
	case "/v1/messages":
		b.required = true
	case "/v1/chat/completions", "/v1/responses":
		b.toContext = true
	}
	if b.field == "" {
		b.field = "max_tokens"
	}
	return b
}

// capValue reads a cap's raw value: a non-negative integer literal, or null (-1: as if absent);
// anything else is not valid.
func capValue(raw []byte) (n int, valid bool) {
	raw = bytes.TrimSpace(raw)
	if bytes.Equal(raw, []byte("null")) {
		return -1, true
	}
	n, err := strconv.Atoi(string(raw)) // JSON has no leading +: the body is valid JSON
	return n, err == nil && n >= 0
}

// capValueLax reads a cap of the OpenAI routes as vLLM's and SGLang's request models read it
// (pydantic's lax mode): what capValue reads, a number with no fraction (100.0, 1e2) and a string
// of digits ("100") too; the engine gets the body as the client sent it.
func capValueLax(raw []byte) (n int, valid bool) {
	if n, valid = capValue(raw); valid {
		return n, true
	}
	raw = bytes.TrimSpace(raw)
	if len(raw) > 2 && raw[0] == '"' && raw[len(raw)-1] == '"' {
		digits := raw[1 : len(raw)-1]
		if len(digits) == 0 || len(digits) > 15 || bytes.IndexFunc(digits, func(r rune) bool { return r < '0' || r > '9' }) >= 0 {
			return 0, false
		}
		n, err := strconv.Atoi(string(digits))
		return n, err == nil
	}
	if len(raw) == 0 || (raw[0] < '0' || raw[0] > '9') {
		return 0, false // not a non-negative number (JSON has no leading + or .)
	}
	f, err := strconv.ParseFloat(string(raw), 64)
	if err != nil || f != math.Trunc(f) || f > 1<<53 {
		return 0, false
	}
	return int(f), true
}

// writeBudget writes b, a default cap, into body: the route's cap member, or SGLang's
// sampling_params.max_new_tokens (its object made when absent; a list of them is left alone:
// each needs its own). Every other byte is unchanged.
func writeBudget(body []byte, path string, b budgetOf) ([]byte, error) {
	n := []byte(strconv.Itoa(b.tokens))
	if path != "/generate" {
		return openai.Set(body, b.field, n)
	}
	sp, ok := openai.Get(body, "sampling_params")
	if sp = bytes.TrimSpace(sp); !ok || bytes.Equal(sp, []byte("null")) {
		sp = []byte("{}")
	}
	if len(sp) == 0 || sp[0] != '{' {
		return nil, errors.New("sampling_params is not an object")
	}
	sp, err := openai.Set(sp, "max_new_tokens", n)
	if err != nil {
		return nil, err
	}
	return openai.Set(body, "sampling_params", sp)
}

// usageAsk is what Baton asked of a stream's usage beyond what its client asked: include, the
// usage-only event (stream_options.include_usage); each, usage on every event
// (continuous_usage_stats), which clientEach says the client had asked already.
type usageAsk struct {
	include, each, clientEach bool
}

// askUsage returns body with stream_options.include_usage true — and continuous_usage_stats
// true when each, which vLLM and SGLang both take (vLLM's should_include_usage,
// vllm/entrypoints/openai/serving_engine.py; SGLang's serving_chat.py and
// serving_completions.py) — and what Baton had to set. A stream_options that is no object is
// the engine's to refuse: nothing is asked.
func askUsage(body []byte, each bool) ([]byte, usageAsk) {
	var ask usageAsk
	opts, ok := openai.Get(body, "stream_options")
	if !ok || bytes.Equal(bytes.TrimSpace(opts), []byte("null")) {
		opts = []byte("{}")
	}
	if len(opts) == 0 || opts[0] != '{' {
		return body, ask
	}
	isTrue := func(key string) bool {
		v, ok := openai.Get(opts, key)
		return ok && bytes.Equal(bytes.TrimSpace(v), []byte("true"))
	}
	var sets []openai.Field
	if !isTrue("include_usage") {
		sets, ask.include = append(sets, openai.Field{Key: "include_usage", Value: []byte("true")}), true
	}
	ask.clientEach = isTrue("continuous_usage_stats")
	if each && !ask.clientEach {
		sets, ask.each = append(sets, openai.Field{Key: "continuous_usage_stats", Value: []byte("true")}), true
	}
	if len(sets) == 0 {
		return body, usageAsk{}
	}
	o, err := openai.Edit(opts, sets, nil)
	if err != nil {
		return body, usageAsk{}
	}
	out, err := openai.Set(body, "stream_options", o)
	if err != nil {
		return body, usageAsk{}
	}
	return out, ask
}

// settleTenant settles a request's lease with what it cost by what the engines did
// (record.Charge): the engine's usage when the answer carried one; nothing when no engine was
// given the request; otherwise its prompt and what was generated for it.
//
// A request charged its prompt (no usage came, no engine reported its prompt) is settled once
// the worker that computed it has counted that prompt (its /tokenize: every shape it can count,
// the rest by its bytes), so that a prompt the body's bytes / 4 underestimate (short words, CJK)
// is charged what the engine computed; the ask runs after the request ended. Without a worker
// to ask, the prompt is charged its bytes (promptBytes).
func (d *Director) settleTenant(rec *record.Record, ls *lease) {
	if ls == nil || ls.ls[0] == nil && ls.ls[1] == nil {
		return
	}
	// Where no engine counts the prompt, it is charged its bytes: a bound no tokenizer exceeds,
	// where the reservation's bytes / 4 was a guess that short words or CJK double.
	bound := ls.estimate
	if !ls.counted {
		bound = promptBytes(ls.req.Path, ls.req.Request.Body)
	}
	if rec.UsageKnown || rec.EnginePrompt > 0 || ls.counted || !rec.AnswerComputed && !rec.PrefillComputed || d.o.Tenancy.CountPrompt == nil {
		prompt, completion := rec.Charge(bound, ls.completion)
		ls.settle(d.o.Tenancy.Limiter, prompt+completion)
		d.countCharge(rec, prompt, completion)
		return
	}
	snap := *rec // the record's facts now; the reporters read rec itself
	worker := cmp.Or(rec.Prefill, rec.Worker)
	model := cmp.Or(rec.Served, rec.Model)
	body, path := bytes.Clone(ls.req.Request.Body), ls.req.Path
	d.settling.Go(func() {
		ctx, cancel := context.WithTimeout(context.Background(), countPromptTimeout)
		defer cancel()
		estimate := bound
		if n, ok := d.o.Tenancy.CountPrompt(ctx, worker, model, path, body); ok && n > 0 {
			estimate = n
		}
		prompt, completion := snap.Charge(estimate, ls.completion)
		ls.settle(d.o.Tenancy.Limiter, prompt+completion)
		d.countCharge(&snap, prompt, completion)
	})
}

// countCharge counts what a reserved request was charged in its tenant's token counters
// (baton_tenant_tokens_total): the usage of an answer that carried it, else what Charge made of
// what the engines did — a stream the client left, an answer cut by its engine — so that the
// counters add up to what the limits were charged, not only to the answers that ended whole.
func (d *Director) countCharge(rec *record.Record, prompt, completion int) {
	if d.metrics == nil || prompt+completion == 0 {
		return
	}
	model := rec.ModelLabel
	if model == "" {
		model = d.metrics.Model(rec.Model)
	}
	name := rec.TenantName()
	d.metrics.TenantTokens.WithLabelValues(name, model, "prompt").Add(float64(prompt))
	d.metrics.TenantTokens.WithLabelValues(name, model, "completion").Add(float64(completion))
	if rec.UsageKnown && rec.Usage.Cached > 0 {
		d.metrics.TenantTokens.WithLabelValues(name, model, "cached").Add(float64(rec.Usage.Cached))
	}
}

// settle settles every rule's lease with what the request used.
func (ls *lease) settle(l *tenant.Limiter, used int) {
	for _, x := range ls.ls {
		l.Settle(x, used)
	}
}

// RateLimitHeaders sets OpenAI's rate-limit headers from d, for the limits the rule has: the
// SDKs back off by them. The names are written canonical, so that setting them costs no
// canonicalisation.
func RateLimitHeaders(h map[string][]string, d tenant.Decision) {
	if d.Requests.Limit == 0 && d.Tokens.Limit == 0 {
		return
	}
	vals := make([]string, 6) // one backing array for the six values
	set := func(i int, key, v string) { vals[i] = v; h[key] = vals[i : i+1 : i+1] }
	if w := d.Requests; w.Limit > 0 {
		set(0, "X-Ratelimit-Limit-Requests", strconv.Itoa(w.Limit))
		set(1, "X-Ratelimit-Remaining-Requests", strconv.Itoa(w.Remaining))
		set(2, "X-Ratelimit-Reset-Requests", ResetString(w.Reset))
	}
	if w := d.Tokens; w.Limit > 0 {
		set(3, "X-Ratelimit-Limit-Tokens", strconv.Itoa(w.Limit))
		set(4, "X-Ratelimit-Remaining-Tokens", strconv.Itoa(w.Remaining))
		set(5, "X-Ratelimit-Reset-Tokens", ResetString(w.Reset))
	}
}

// ResetString spells a reset as OpenAI does: "1s", "6m0s", "120ms".
func ResetString(d time.Duration) string {
	if d < time.Second {
		return strconv.FormatInt(max(0, d.Milliseconds()), 10) + "ms"
	}
	return d.Round(time.Second).String()
}

// TenantView is one tenant in GET /tenants and on the status page: never a key or its hash.
type TenantView struct {
	Name        string     `json:"name"`
	Models      []string   `json:"models"`
	Weight      float64    `json:"weight"`
	MaxPriority string     `json:"max_priority"`
	Rules       []RuleView `json:"limits"`
}

// RuleView is one of a tenant's rules, with its use now.
type RuleView struct {
	Model             string `json:"model,omitempty"`
	RequestsPerMinute int    `json:"requests_per_minute,omitempty"`
	TokensPerMinute   int    `json:"tokens_per_minute,omitempty"`
	MaxConcurrent     int    `json:"max_concurrent,omitempty"`
	// What is left now, and when the bucket is whole again.
	RequestsRemaining *int   `json:"requests_remaining,omitempty"`
	RequestsReset     string `json:"requests_reset,omitempty"`
	TokensRemaining   *int   `json:"tokens_remaining,omitempty"`
	TokensReset       string `json:"tokens_reset,omitempty"`
	InFlight          *int   `json:"in_flight,omitempty"`
	// TokensCharged is what this replica charged the rule since it started, after the engines'
	// usage.
	TokensCharged int64 `json:"tokens_charged"`
}

// TenantViews are the tenants with their limits and use now.
func (d *Director) TenantViews(ctx context.Context) (out []TenantView, storeErr error) {
	out = []TenantView{}
	for _, t := range d.Tenants().Tenants() {
		v := TenantView{Name: t.Name, Models: t.Models(), Weight: t.Weight, MaxPriority: t.MaxPriority, Rules: []RuleView{}}
		if v.Models == nil {
			v.Models = []string{}
		}
		for _, r := range t.Rules() {
			dec, err := d.o.Tenancy.Limiter.Peek(ctx, r)
			if err != nil {
				storeErr = err
			}
			rv := RuleView{Model: r.Model, RequestsPerMinute: r.RPM, TokensPerMinute: r.TPM, MaxConcurrent: r.Concurrent,
				TokensCharged: d.o.Tenancy.Limiter.Charged(r.ID)}
			if r.RPM > 0 {
				rv.RequestsRemaining, rv.RequestsReset = &dec.Requests.Remaining, ResetString(dec.Requests.Reset)
			}
			if r.TPM > 0 {
				rv.TokensRemaining, rv.TokensReset = &dec.Tokens.Remaining, ResetString(dec.Tokens.Reset)
			}
			if r.Concurrent > 0 {
				rv.InFlight = &dec.InFlight
			}
			v.Rules = append(v.Rules, rv)
		}
		out = append(out, v)
	}
	return out, storeErr
}

// contextLen is the most tokens a request for model may hold, prompt and completion, on every
// worker that serves it: the least max_model_len its engines report on the model's card in
// /v1/models (vLLM's and SGLang's ModelCard; an adapter's card reports none, and its base
// model's holds). On SGLang one less: its tokenizer manager refuses a prompt and cap that reach
// its context length (_validate_one_request, input + max_new_tokens >= context_len in the
// releases that check it), where vLLM refuses only past it. False when no worker serving model
// reports one (a configured model its engine did not list, an engine that says nothing).
func (d *Director) contextLen(model string) (int, bool) {
	if d.reg == nil {
		return 0, false
	}
	least := 0
	for _, w := range d.reg.Snapshot().Workers {
		in := w.Info()
		if in == nil || w.Removed() {
			continue
		}
		for _, m := range in.Models {
			if m.ID != model {
				continue
			}
			n := maxModelLen(m.Card)
			if n <= 0 && m.Parent != "" {
				for _, b := range in.Models {
					if b.ID == m.Parent {
						n = maxModelLen(b.Card)
					}
				}
			}
			if n <= 0 {
				continue
			}
			if w.Runtime() == config.RuntimeSGLang {
				n--
			}
			if least == 0 || n < least {
				least = n
			}
		}
	}
	return least, least > 0
}

// maxModelLen reads a model card's max_model_len; 0 when it has none (or null, or not an
// integer).
func maxModelLen(card json.RawMessage) int {
	raw, ok := openai.Get(card, "max_model_len")
	if !ok {
		return 0
	}
	n, err := strconv.Atoi(string(raw))
	if err != nil {
		return 0
	}
	return n
}

// promptBytes is the bytes of a request's prompt: its route's prompt members and what shapes a
// chat's template (tools) — the whole body for a route whose prompt Baton does not know. No
// tokenizer makes more tokens of a text than it has bytes, so that a prompt no engine counted
// is never taken for less than it costs (a bound, where bytes / 4 is a guess).
func promptBytes(path string, body []byte) int {
	r := routes.Of(path)
	n := 0
	for _, members := range [][]string{r.Prompt, r.TokenizeExtra} {
		for _, m := range members {
			if raw, ok := openai.Get(body, m); ok {
				n += len(raw)
			}
		}
	}
	if r.Batch == routes.BatchCompletions {
		if raw, ok := openai.Get(body, "prompt_embeds"); ok {
			n += len(raw)
		}
	}
	if n == 0 {
		return len(body)
	}
	return n
}
