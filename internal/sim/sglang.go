package sim

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"sort"
	"strconv"
	"sync"
	"time"
)

// fakeBootstrapHost is the bootstrap host SGLang's own health checks use: no pairing happens.
const fakeBootstrapHost = "2.2.2.2"

// roomKV is what a prefill engine hands its decode partner through the bootstrap server.
type roomKV struct {
	Digest        string  `json:"digest"`
	FirstToken    uint32  `json:"first_token"`
	PromptTokens  int     `json:"prompt_tokens"`
	CachedTokens  int     `json:"cached_tokens"`
	InputLogprobs [][]any `json:"input_logprobs,omitempty"`
}

// room is one SGLang rendezvous: prefill and decode legs with the same (rank, bootstrap_room).
type room struct {
	Key            string    `json:"key"`
	Created        time.Time `json:"created"`
	PrefillArrived bool      `json:"prefill_arrived"`
	DecodeArrived  bool      `json:"decode_arrived"`
	decode         chan struct{}
	dOnce          sync.Once
	kv             chan roomKV
	received       chan struct{}
	rOnce          sync.Once
}

type roomTable struct {
	mu sync.Mutex
	m  map[string]*room
}

func newRoomTable() *roomTable { return &roomTable{m: map[string]*room{}} }

func roomKey(rank int, roomID uint64) string {
	return strconv.Itoa(rank) + "/" + strconv.FormatUint(roomID, 10)
}

func (t *roomTable) get(key string, mark func(*room)) *room {
	t.mu.Lock()
	defer t.mu.Unlock()
	r, ok := t.m[key]
	if !ok {
		r = &room{Key: key, Created: time.Now(), decode: make(chan struct{}), kv: make(chan roomKV, 1), received: make(chan struct{})}
		t.m[key] = r
	}
	mark(r)
	return r
}

func (t *roomTable) remove(r *room) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.m[r.Key] == r {
		delete(t.m, r.Key)
	}
}

func (t *roomTable) list() []room {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := make([]room, 0, len(t.m))
	for _, r := range t.m {
		out = append(out, room{Key: r.Key, Created: r.Created, PrefillArrived: r.PrefillArrived, DecodeArrived: r.DecodeArrived})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Created.Before(out[j].Created) })
	return out
}

// prefillRendezvous runs the prefill side of a room: wait for the decode leg, compute, hand
// the KV over, and return once the decode leg has it. SGLang answers a prefill request only
// after the transfer.
func (e *Engine) prefillRendezvous(ctx context.Context, rank int, roomID uint64, compute func() (roomKV, error)) *apiError {
	r := e.rooms.get(roomKey(rank, roomID), func(r *room) { r.PrefillArrived = true })
	defer e.rooms.remove(r)
	t := time.NewTimer(e.cfg.BootstrapTimeout)
	defer t.Stop()
	select {
	case <-r.decode:
	case <-t.C:
		return errorf(500, "Request %d timed out after %gs in KVPoll.Bootstrapping", roomID, e.cfg.BootstrapTimeout.Seconds())
	case <-ctx.Done():
		return errorf(499, "prefill request cancelled while bootstrapping room %d", roomID)
	}
	kv, err := compute()
	if err != nil {
		return errorf(499, "prefill request cancelled: %v", err)
	}
	r.kv <- kv
	select {
	case <-r.received:
		return nil
	case <-t.C:
		return errorf(500, "Prefill transfer failed for request %d: decode did not take the KV", roomID)
	case <-ctx.Done():
		return errorf(499, "prefill request cancelled during transfer of room %d", roomID)
	}
}

// serveJoin is the decode side of a room, on the prefill engine's bootstrap server: register
// arrival, then wait for the prefill's KV.
func (e *Engine) serveJoin(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	roomID, err := strconv.ParseUint(q.Get("room"), 10, 64)
	if err != nil {
		writeJSON(w, 400, map[string]any{"error": "bad room"})
		return
	}
	rank, err := strconv.Atoi(q.Get("dp_rank"))
	if err != nil || rank < 0 {
		rank = int(roomID % uint64(e.cfg.DPSize))
	}
	rm := e.rooms.get(roomKey(rank, roomID), func(r *room) { r.DecodeArrived = true })
	rm.dOnce.Do(func() { close(rm.decode) })
	t := time.NewTimer(e.cfg.BootstrapTimeout)
	defer t.Stop()
	select {
	case kv := <-rm.kv:
		writeJSON(w, 200, kv)
		rm.rOnce.Do(func() { close(rm.received) })
	case <-t.C:
		e.rooms.remove(rm)
		writeJSON(w, 500, map[string]any{"error": fmt.Sprintf("Request %d timed out after %gs in KVPoll.WaitingForInput", roomID, e.cfg.BootstrapTimeout.Seconds())})
	case <-r.Context().Done():
	}
}

// joinRoom is the decode engine's call to its partner's bootstrap server. Like SGLang's decode,
// it keeps trying to reach a bootstrap server that does not answer yet, until its timeout.
func (e *Engine) joinRoom(ctx context.Context, host string, port int, roomID uint64, rank int) (*roomKV, *apiError) {
	u := fmt.Sprintf("http://%s/bootstrap/join?room=%d&dp_rank=%d", netJoin(host, port), roomID, rank)
	ctx, cancel := context.WithTimeout(ctx, e.cfg.BootstrapTimeout+5*time.Second)
	defer cancel()
	giveUp := time.Now().Add(e.cfg.BootstrapTimeout)
	var resp *http.Response
	for {
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, u, nil)
		var err error
		resp, err = e.client.Do(req)
		if err == nil {
			break
		}
		if ctx.Err() != nil {
			return nil, errorf(499, "decode request cancelled while waiting for room %d", roomID)
		}
		if time.Now().After(giveUp) {
			return nil, errorf(500, "bootstrap server %s unreachable: %v", netJoin(host, port), err)
		}
		if sleep(ctx, 50*time.Millisecond) != nil {
			return nil, errorf(499, "decode request cancelled while waiting for room %d", roomID)
		}
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		var body struct {
			Error string `json:"error"`
		}
		_ = json.NewDecoder(resp.Body).Decode(&body)
		return nil, errorf(500, "%s", body.Error)
	}
	var kv roomKV
	if err := json.NewDecoder(resp.Body).Decode(&kv); err != nil {
		return nil, errorf(500, "reading KV of room %d: %v", roomID, err)
	}
	return &kv, nil
}
