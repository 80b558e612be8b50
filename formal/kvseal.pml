/* The kvseal transfer protocol for SPIN: the same machines, bounds and properties as formal/kvseal.tla (read its
 * header first), written as one process per lease (all of its messages and steps), one per request (the router
 * and the client) and one for the prefill worker's crashes and fencing. Every step is one atomic guarded action.
 *
 * A lease l is request l/2, attempt l%2. Request RETRY is sent again under the same id after its first attempt
 * ended with 503 or a client gone. Request OVER fits decode's pool but never prefill's. There are NP pages, fewer
 * than the NR requests need together. The network is a set of messages (bits): delivered in any order, each one
 * lost at most as the fault budget allows. Safety properties are assertions; "every request ends" is checked in
 * every terminal state (the monitor's timeout). Variants: -DV_<name>=1, e.g. -DV_free_on_abort=1.
 */
#ifndef NR
#define NR 3
#endif
#ifndef NP
#define NP 2
#endif
#ifndef OVER
#define OVER 2
#endif
#define RETRY 0
#ifndef MAXFAULTS
#define MAXFAULTS 1
#endif
#define NL (NR * 2)
#define NOBODY 99
#ifndef V_placeholder
#define V_placeholder 0
#endif
#ifndef V_free_on_abort
#define V_free_on_abort 0
#endif
#ifndef V_no_coverage
#define V_no_coverage 0
#endif
#ifndef V_lease_reuse
#define V_lease_reuse 0
#endif
#ifndef V_fence_without_epoch
#define V_fence_without_epoch 0
#endif
#ifndef V_commit_after_expiry
#define V_commit_after_expiry 0
#endif

/* message types (kvseal/transfer/messages.py); Fence is a step of its own here */
mtype:msgtype = { Reserve, Lease, Prefill, Commit, Ack, Abort, WriterDone, Fence, Forget };
/* decode lease (kvseal/protocol/decode.py), prefill transfer (prefill.py), router request (router.py) */
mtype:lease = { L_NONE, RESERVED, VERIFYING, RUNNING, QUARANTINED, L_CLOSED };
mtype:xfer = { X_NONE, COMPUTING, WRITING, COMMITTING, X_CLOSED };
mtype:req = { R_NONE, RESERVING, TRANSFERRING, FORGETTING, STREAMING, R_CLOSED };

/* a message is (kind, lease); kinds carry the message's type and its one field */
#define K_RESERVE 0
#define K_LEASE_OK 1
#define K_LEASE_503 2
#define K_PREFILL 3
#define K_COMMIT 4
#define K_VERIFY 5
#define K_D200 6
#define K_D500 7
#define K_D503 8
#define K_A200 9
#define K_A400 10
#define K_A500 11
#define K_A503 12
#define K_FINAL 13
#define K_ABORT_WD 14
#define K_ABORT_NOWD 15
#define K_WRITERDONE 16
#define K_FORGET_R 17
#define K_FORGET_D 18
#define K_FORGET_RA 19
#define K_FORGET_DA 20
#define NK 21
#define M(k, l) net[(k) * NL + (l)]
#define LATE(k, l) late[(k) * NL + (l)]

/* page states (kvseal/kv/pool.py) */
#define P_FREE 0
#define P_RESERVED 1
#define P_OWNED 2
#define P_QUARANTINED 3

/* outcomes */
#define O_OPEN 0
#define O_GONE 1
#define O_200 2
#define O_400 3
#define O_500 4
#define O_503 5

bit net[NK * NL];
bit late[NK * NL];  /* copies the network will deliver a second time, later */
mtype:lease dl[NL]; byte dpg[NL]; byte lgen[NL]; byte capep[NL]; bool expired[NL];
byte pst[NP]; byte pown[NP]; byte pgen[NP]; byte pdat[NP]; bool pfull[NP];  /* pdat: writer lease + 1 */
byte epoch;
mtype:xfer xst[NL]; bool xfull[NL]; bool forgotten[NL]; bool pup = 1;
mtype:req rq[NR]; byte att[NR]; bool gone[NL]; byte outcome[NL]; bool corrupt[NL];
byte faults;
hidden mtype:msgtype delivered;  /* the type of the message a step consumes (for the reader; not state) */
hidden byte k, p, j;  /* scratch of the atomic steps: never part of the state */

#define REQ(l) ((l) / 2)
#define CUR(r) ((r) * 2 + att[r])
#define NONCE(l) (V_lease_reuse -> REQ(l) * 2 : (l))
#define OPEN(k) (dl[k] == RESERVED || dl[k] == VERIFYING || dl[k] == QUARANTINED || dl[k] == RUNNING)
#define FAULT (faults < MAXFAULTS)
#define IDLE(l) (!M(K_PREFILL, l) && !M(K_COMMIT, l) && !M(K_VERIFY, l) && xst[l] != COMPUTING && xst[l] != WRITING && xst[l] != COMMITTING)
#define NOANSWER(l) (!M(K_A200, l) && !M(K_A400, l) && !M(K_A500, l) && !M(K_A503, l))
#define END(l, o) if :: outcome[l] == O_OPEN -> outcome[l] = o :: else -> skip fi

/* decode finds a lease by request id, then compares nonces */
inline find(l, k) {
    k = NL;
    if :: OPEN(REQ(l) * 2) && NONCE(REQ(l) * 2) == NONCE(l) -> k = REQ(l) * 2
       :: else -> skip fi;
    if :: k == NL && OPEN(REQ(l) * 2 + 1) && NONCE(REQ(l) * 2 + 1) == NONCE(l) -> k = REQ(l) * 2 + 1
       :: else -> skip fi
}

inline free_page(p) {
    pst[p] = P_FREE; pown[p] = NOBODY;
    if :: !V_lease_reuse -> pgen[p]++ :: else -> skip fi
}

proctype lease(byte l) {
    byte r = REQ(l);
end:
    do
    /* ---- decode ---- */
    /* - --reserve--> RESERVED */
    :: atomic { M(K_RESERVE, l) -> delivered = Reserve; M(K_RESERVE, l) = 0;
        if :: (pst[0] == P_FREE || pst[NP - 1] == P_FREE) && !OPEN(r * 2) && !OPEN(r * 2 + 1) ->
                if :: pst[0] == P_FREE -> p = 0
#if NP > 1
                   :: pst[NP - 1] == P_FREE -> p = NP - 1
#endif
                fi;
                pst[p] = P_RESERVED; pown[p] = r; dl[l] = RESERVED; dpg[l] = p; lgen[l] = pgen[p];
                capep[l] = epoch; M(K_LEASE_OK, l) = 1
           :: else -> M(K_LEASE_503, l) = 1
        fi }
    /* RESERVED --commit--> VERIFYING; RESERVED --commit--> QUARANTINED (coverage fails);
       RUNNING --commit--> RUNNING (a duplicate) */
    :: atomic { M(K_COMMIT, l) -> delivered = Commit; M(K_COMMIT, l) = 0; find(l, k);
        if :: capep[l] != epoch || (expired[l] && !V_commit_after_expiry) || k == NL -> M(K_D503, l) = 1
           :: else ->
                if :: dl[k] == RUNNING -> M(K_D200, l) = 1
                   :: dl[k] != RUNNING && dl[k] != RESERVED -> M(K_D503, l) = 1
                   :: dl[k] == RESERVED && !xfull[l] && !V_no_coverage ->
                        dl[k] = QUARANTINED; pst[dpg[k]] = P_QUARANTINED; M(K_D500, l) = 1
                   :: dl[k] == RESERVED && (xfull[l] || V_no_coverage) ->
                        dl[k] = VERIFYING; M(K_VERIFY, l) = 1;
                        assert(!expired[k])  /* no commit accepted for a lease past its TTL */
                fi
        fi }
    /* VERIFYING --verified--> RUNNING | QUARANTINED */
    /* QUARANTINED --verified--> QUARANTINED (aborted while verifying) */
    :: atomic { M(K_VERIFY, l) -> delivered = Commit; M(K_VERIFY, l) = 0; k = NL;
        if :: (dl[r * 2] == VERIFYING || dl[r * 2] == QUARANTINED) && NONCE(r * 2) == NONCE(l) -> k = r * 2
           :: else -> skip fi;
        if :: k == NL && (dl[r * 2 + 1] == VERIFYING || dl[r * 2 + 1] == QUARANTINED) && NONCE(r * 2 + 1) == NONCE(l) ->
                k = r * 2 + 1
           :: else -> skip fi;
        if :: k == NL || dl[k] == QUARANTINED -> M(K_D503, l) = 1
           :: else -> p = dpg[k];
                if :: pst[p] == P_RESERVED && pown[p] == r && pgen[p] == lgen[k] && pdat[p] == l + 1 ->
                        dl[k] = RUNNING; pst[p] = P_OWNED; M(K_D200, l) = 1;
                        /* the read: the page holds this lease's whole prompt, and the request can fit */
                        assert(pdat[p] == k + 1 && pfull[p]);
                        assert(r != OVER)
                   :: else -> dl[k] = QUARANTINED; pst[p] = P_QUARANTINED; M(K_D500, l) = 1
                fi
        fi }
    /* RUNNING --finished--> CLOSED */
    :: atomic { dl[l] == RUNNING -> dl[l] = L_CLOSED; free_page(dpg[l]); M(K_FINAL, l) = 1 }
    /* RESERVED|VERIFYING --abort|router_gone--> QUARANTINED (router_gone is decode's own abort, no writer done) */
    /* RESERVED|VERIFYING --abort--> CLOSED (the writer is known done; or deferred release off: free_on_abort) */
    /* QUARANTINED --abort--> CLOSED (the writer is known done) */
    /* RUNNING --abort|router_gone--> CLOSED (Stop) */
    :: atomic { (M(K_ABORT_WD, l) || M(K_ABORT_NOWD, l)) -> delivered = Abort; find(l, k);
        if :: k != NL && (dl[k] == RUNNING || M(K_ABORT_WD, l) || V_free_on_abort) ->
                dl[k] = L_CLOSED; free_page(dpg[k])
           :: k != NL && !(dl[k] == RUNNING || M(K_ABORT_WD, l) || V_free_on_abort) ->
                dl[k] = QUARANTINED; pst[dpg[k]] = P_QUARANTINED
           :: else -> skip
        fi;
        if :: M(K_ABORT_WD, l) -> M(K_ABORT_WD, l) = 0 :: else -> M(K_ABORT_NOWD, l) = 0 fi }
    /* QUARANTINED --writer_done--> CLOSED */
    :: atomic { M(K_WRITERDONE, l) -> delivered = WriterDone; M(K_WRITERDONE, l) = 0; find(l, k);
        if :: k != NL && dl[k] == QUARANTINED && capep[l] == epoch -> dl[k] = L_CLOSED; free_page(dpg[k])
           :: else -> skip fi }
    /* time passes: fair for a quarantined lease, or one whose commit can no longer come; a fault (the race the
       TTL exists for) while its commit may still come */
    :: atomic { !expired[l] && (dl[l] == QUARANTINED || (dl[l] == RESERVED && IDLE(l))) -> expired[l] = 1 }
    :: atomic { !expired[l] && (dl[l] == RESERVED || dl[l] == VERIFYING) && FAULT -> faults++; expired[l] = 1 }
    /* RESERVED|VERIFYING --expire--> QUARANTINED (AskForget) */
    /* QUARANTINED --expire--> QUARANTINED (AskForget again) */
    :: atomic { expired[l] && (dl[l] == RESERVED || dl[l] == VERIFYING || dl[l] == QUARANTINED) &&
                   !M(K_FORGET_D, l) && !M(K_FORGET_DA, l) ->
        dl[l] = QUARANTINED; pst[dpg[l]] = P_QUARANTINED; M(K_FORGET_D, l) = 1 }
    /* QUARANTINED --forget_answer--> CLOSED */
    :: atomic { M(K_FORGET_DA, l) -> delivered = Forget; M(K_FORGET_DA, l) = 0;
        if :: dl[l] == QUARANTINED -> dl[l] = L_CLOSED; free_page(dpg[l]) :: else -> skip fi }

    /* ---- prefill ---- */
    /* - --prefill--> COMPUTING (admission first; a forgotten or finished lease is refused) */
    /* COMPUTING|WRITING|COMMITTING --prefill--> COMPUTING|WRITING|COMMITTING (a copy: dropped) */
    :: atomic { M(K_PREFILL, l) && pup -> delivered = Prefill; M(K_PREFILL, l) = 0;
        if :: xst[l] == COMPUTING || xst[l] == WRITING || xst[l] == COMMITTING -> skip
           :: xst[l] == X_CLOSED || (xst[l] == X_NONE && forgotten[NONCE(l)]) -> M(K_A503, l) = 1
           :: else ->
                if :: r == OVER && (V_placeholder || FAULT) ->  /* the 2026 placeholder: the bug, or a fault */
                        if :: !V_placeholder -> faults++; corrupt[l] = 1 :: else -> skip fi;
                        xst[l] = COMPUTING; xfull[l] = 0
                   :: r == OVER && !V_placeholder -> M(K_A400, l) = 1
                   :: r != OVER -> xst[l] = COMPUTING
                fi
        fi }
    /* COMPUTING --failed--> CLOSED: the engine fails the request (a fault), prefill answers 503 */
    :: atomic { pup && xst[l] == COMPUTING && FAULT -> faults++; xst[l] = X_CLOSED; forgotten[NONCE(l)] = 1;
        M(K_A503, l) = 1 }
    /* COMPUTING --prefilled--> WRITING */
    :: atomic { pup && xst[l] == COMPUTING -> xst[l] = WRITING }
    /* WRITING --written--> COMMITTING | CLOSED (the transport refused a fenced writer) */
    :: atomic { pup && xst[l] == WRITING -> p = dpg[l];
        if :: capep[l] == epoch ->
                assert(pown[p] == r && pgen[p] == lgen[l] && (pst[p] == P_RESERVED || pst[p] == P_QUARANTINED));
                pdat[p] = l + 1; pfull[p] = xfull[l]; xst[l] = COMMITTING; M(K_COMMIT, l) = 1
           :: else -> xst[l] = X_CLOSED; forgotten[NONCE(l)] = 1; M(K_A503, l) = 1
        fi }
    /* COMMITTING --acked--> CLOSED (accepted; or refused: SendWriterDone) */
    :: atomic { pup && xst[l] == COMMITTING && (M(K_D200, l) || M(K_D500, l) || M(K_D503, l)) -> delivered = Ack;
        xst[l] = X_CLOSED; forgotten[NONCE(l)] = 1;
        if :: M(K_D200, l) -> M(K_D200, l) = 0; M(K_A200, l) = 1
           :: M(K_D500, l) -> M(K_D500, l) = 0; M(K_WRITERDONE, l) = 1; M(K_A500, l) = 1
           :: M(K_D503, l) -> M(K_D503, l) = 0; M(K_WRITERDONE, l) = 1; M(K_A503, l) = 1
        fi }
    /* COMMITTING --acked--> CLOSED, undelivered: decode's answer can no longer come */
    :: atomic { pup && xst[l] == COMMITTING && !M(K_COMMIT, l) && !M(K_VERIFY, l) && !M(K_D200, l) && !M(K_D500, l) &&
                   !M(K_D503, l) ->
        xst[l] = X_CLOSED; forgotten[NONCE(l)] = 1; M(K_WRITERDONE, l) = 1; M(K_A503, l) = 1 }
    /* COMPUTING --forget--> CLOSED (StopCompute, Settle 503) */
    /* WRITING|COMMITTING --forget--> WRITING|COMMITTING (a write may land: no answer) */
    :: atomic { pup && (M(K_FORGET_R, l) || M(K_FORGET_D, l)) -> delivered = Forget;
        forgotten[NONCE(l)] = 1;
        if :: xst[l] == COMPUTING -> xst[l] = X_CLOSED; M(K_A503, l) = 1 :: else -> skip fi;
        if :: xst[l] != WRITING && xst[l] != COMMITTING ->
                if :: M(K_FORGET_R, l) -> M(K_FORGET_RA, l) = 1 :: else -> M(K_FORGET_DA, l) = 1 fi
           :: else -> skip fi;
        if :: M(K_FORGET_R, l) -> M(K_FORGET_R, l) = 0 :: else -> M(K_FORGET_D, l) = 0 fi }
    /* decode's answer to a commit whose transfer is gone (its prefill crashed meanwhile) goes nowhere */
    :: atomic { xst[l] != COMMITTING && (M(K_D200, l) || M(K_D500, l) || M(K_D503, l)) ->
        M(K_D200, l) = 0; M(K_D500, l) = 0; M(K_D503, l) = 0 }
    /* a message to a dead prefill is lost */
    :: atomic { !pup && (M(K_PREFILL, l) || M(K_FORGET_R, l) || M(K_FORGET_D, l)) ->
        M(K_PREFILL, l) = 0; M(K_FORGET_R, l) = 0; M(K_FORGET_D, l) = 0 }

    /* ---- router ---- */
    /* RESERVING --reserve_failed--> CLOSED: the reservation's answer can no longer come (503) */
    :: atomic { l == CUR(r) && rq[r] == RESERVING && !M(K_RESERVE, l) && !M(K_LEASE_OK, l) && !M(K_LEASE_503, l) ->
        rq[r] = R_CLOSED; END(l, O_503) }
    /* RESERVING --lease--> TRANSFERRING | CLOSED (client left: SendAbort writer done); --reserve_failed--> CLOSED */
    :: atomic { (M(K_LEASE_OK, l) || M(K_LEASE_503, l)) && l == CUR(r) && rq[r] == RESERVING -> delivered = Lease;
        if :: M(K_LEASE_OK, l) && gone[l] -> rq[r] = R_CLOSED; M(K_ABORT_WD, l) = 1
           :: M(K_LEASE_OK, l) && !gone[l] -> rq[r] = TRANSFERRING; M(K_PREFILL, l) = 1
           :: M(K_LEASE_503, l) -> rq[r] = R_CLOSED; END(l, O_503)
        fi;
        M(K_LEASE_OK, l) = 0; M(K_LEASE_503, l) = 0 }
    /* TRANSFERRING --acked--> STREAMING | CLOSED (client left) */
    /* TRANSFERRING --refused--> CLOSED (SendAbort writer done, Fail) */
    :: atomic { (M(K_A200, l) || M(K_A400, l) || M(K_A500, l) || M(K_A503, l)) && l == CUR(r) &&
                   rq[r] == TRANSFERRING -> delivered = Ack;
        if :: M(K_A200, l) && !gone[l] -> rq[r] = STREAMING
           :: else -> rq[r] = R_CLOSED; M(K_ABORT_WD, l) = 1;
                if :: M(K_A400, l) -> END(l, O_400)
                   :: M(K_A500, l) -> END(l, O_500)
                   :: M(K_A503, l) -> END(l, O_503)
                   :: else -> skip fi
        fi;
        M(K_A200, l) = 0; M(K_A400, l) = 0; M(K_A500, l) = 0; M(K_A503, l) = 0 }
    /* FORGETTING --forget_answer--> CLOSED (SendAbort: writer done iff prefill answered; Fail 503) */
    :: atomic { rq[r] == FORGETTING && l == CUR(r) && (M(K_FORGET_RA, l) || !M(K_FORGET_R, l)) ->
        if :: M(K_FORGET_RA, l) -> M(K_FORGET_RA, l) = 0; M(K_ABORT_WD, l) = 1
           :: else -> M(K_ABORT_NOWD, l) = 1 fi;
        rq[r] = R_CLOSED; END(l, O_503) }
    /* STREAMING --final--> CLOSED */
    :: atomic { M(K_FINAL, l) -> delivered = Ack; M(K_FINAL, l) = 0;
        if :: l == CUR(r) && rq[r] == STREAMING -> rq[r] = R_CLOSED; END(l, O_200) :: else -> skip fi }

    /* ---- the network loses a message ---- */
    :: atomic { FAULT && M(K_RESERVE, l) -> M(K_RESERVE, l) = 0; faults++ }
    :: atomic { FAULT && M(K_LEASE_OK, l) -> M(K_LEASE_OK, l) = 0; faults++ }
    :: atomic { FAULT && M(K_PREFILL, l) -> M(K_PREFILL, l) = 0; faults++ }
    :: atomic { FAULT && M(K_COMMIT, l) -> M(K_COMMIT, l) = 0; faults++ }
    :: atomic { FAULT && M(K_D200, l) -> M(K_D200, l) = 0; faults++ }
    :: atomic { FAULT && M(K_A200, l) -> M(K_A200, l) = 0; faults++ }
    :: atomic { FAULT && M(K_FINAL, l) -> M(K_FINAL, l) = 0; faults++ }
    :: atomic { FAULT && M(K_ABORT_WD, l) -> M(K_ABORT_WD, l) = 0; faults++ }
    :: atomic { FAULT && M(K_WRITERDONE, l) -> M(K_WRITERDONE, l) = 0; faults++ }
    :: atomic { FAULT && M(K_FORGET_R, l) -> M(K_FORGET_R, l) = 0; faults++ }
    :: atomic { FAULT && M(K_FORGET_D, l) -> M(K_FORGET_D, l) = 0; faults++ }

    /* ---- the network delivers a message twice: the messages that act on a lease by its id ---- */
    :: atomic { FAULT && M(K_ABORT_WD, l) && !LATE(K_ABORT_WD, l) -> LATE(K_ABORT_WD, l) = 1; faults++ }
    :: atomic { LATE(K_ABORT_WD, l) && !M(K_ABORT_WD, l) -> M(K_ABORT_WD, l) = 1; LATE(K_ABORT_WD, l) = 0 }
    :: atomic { FAULT && M(K_ABORT_NOWD, l) && !LATE(K_ABORT_NOWD, l) -> LATE(K_ABORT_NOWD, l) = 1; faults++ }
    :: atomic { LATE(K_ABORT_NOWD, l) && !M(K_ABORT_NOWD, l) -> M(K_ABORT_NOWD, l) = 1; LATE(K_ABORT_NOWD, l) = 0 }
    :: atomic { FAULT && M(K_COMMIT, l) && !LATE(K_COMMIT, l) -> LATE(K_COMMIT, l) = 1; faults++ }
    :: atomic { LATE(K_COMMIT, l) && !M(K_COMMIT, l) -> M(K_COMMIT, l) = 1; LATE(K_COMMIT, l) = 0 }
    :: atomic { FAULT && M(K_WRITERDONE, l) && !LATE(K_WRITERDONE, l) -> LATE(K_WRITERDONE, l) = 1; faults++ }
    :: atomic { LATE(K_WRITERDONE, l) && !M(K_WRITERDONE, l) -> M(K_WRITERDONE, l) = 1; LATE(K_WRITERDONE, l) = 0 }
    od
}

proctype request(byte r) {
end:
    do
    /* - --start--> RESERVING (RETRY: once more, same id, after a 503 or a client gone) */
    :: atomic { rq[r] == R_NONE -> rq[r] = RESERVING; M(K_RESERVE, CUR(r)) = 1 }
    :: atomic { rq[r] == R_CLOSED && r == RETRY && att[r] == 0 &&
                   (outcome[CUR(r)] == O_503 || outcome[CUR(r)] == O_GONE) ->
        att[r] = 1; rq[r] = RESERVING; M(K_RESERVE, CUR(r)) = 1 }
    /* TRANSFERRING --unanswered--> FORGETTING: fair once nothing can answer; before that, a slow prefill (fault) */
    :: atomic { rq[r] == TRANSFERRING && NOANSWER(CUR(r)) && !M(K_PREFILL, CUR(r)) && !M(K_COMMIT, CUR(r)) &&
                !M(K_VERIFY, CUR(r)) && !M(K_D200, CUR(r)) && !M(K_D500, CUR(r)) && !M(K_D503, CUR(r)) &&
                (xst[CUR(r)] == X_NONE || xst[CUR(r)] == X_CLOSED) ->
        rq[r] = FORGETTING; M(K_FORGET_R, CUR(r)) = 1 }
    :: atomic { rq[r] == TRANSFERRING && NOANSWER(CUR(r)) && FAULT ->
        faults++; rq[r] = FORGETTING; M(K_FORGET_R, CUR(r)) = 1 }
    /* STREAMING --left--> CLOSED: the stream's silence limit, once its last event can no longer come (503) */
    :: atomic { rq[r] == STREAMING && !M(K_FINAL, CUR(r)) && dl[CUR(r)] != RUNNING ->
        rq[r] = R_CLOSED; END(CUR(r), O_503); M(K_ABORT_WD, CUR(r)) = 1 }
    /* RESERVING|TRANSFERRING|FORGETTING --left--> RESERVING|TRANSFERRING|FORGETTING (guarded: the step runs on) */
    /* STREAMING --left--> CLOSED (SendAbort writer done) */
    :: atomic { FAULT && !gone[CUR(r)] && (rq[r] == RESERVING || rq[r] == TRANSFERRING || rq[r] == FORGETTING ||
                                             rq[r] == STREAMING) ->
        faults++; gone[CUR(r)] = 1; END(CUR(r), O_GONE);
        if :: rq[r] == STREAMING -> rq[r] = R_CLOSED; M(K_ABORT_WD, CUR(r)) = 1 :: else -> skip fi }
    od
}

proctype prefill_worker() {
end:
    do
    /* the prefill worker dies: every transfer in progress is gone, with its answers */
    :: atomic { pup && FAULT -> faults++; pup = 0;
        for (j : 0 .. NL - 1) {
            if :: xst[j] == COMPUTING || xst[j] == WRITING || xst[j] == COMMITTING -> xst[j] = X_CLOSED
               :: else -> skip fi;
            if :: xst[j] != X_NONE -> forgotten[NONCE(j)] = 1 :: else -> skip fi
        } }
    :: atomic { !pup -> pup = 1 }
    /* RESERVED|VERIFYING|QUARANTINED --fence--> CLOSED: declared dead (rightly or not); its epoch moves on */
    :: atomic { FAULT -> faults++; delivered = Fence;
        if :: !V_fence_without_epoch -> epoch++ :: else -> skip fi;
        for (j : 0 .. NL - 1) {
            if :: dl[j] == RESERVED || dl[j] == VERIFYING || dl[j] == QUARANTINED -> dl[j] = L_CLOSED; free_page(dpg[j])
               :: else -> skip fi
        } }
    od
}

/* every terminal state: every request ended, every page back */
active proctype monitor() {
end:
    timeout ->
    atomic {
        for (j : 0 .. NR - 1) { assert(rq[j] == R_CLOSED) }
        for (j : 0 .. NP - 1) { assert(pst[j] == P_FREE) }
        /* the right status: 400 only if it can never fit, 500 only after a corruption, 200 only if it fits */
        for (j : 0 .. NL - 1) {
            assert(outcome[j] != O_400 || REQ(j) == OVER);
            assert(outcome[j] != O_500 || corrupt[j]);
            assert(outcome[j] != O_200 || REQ(j) != OVER)
        }
    }
}

init {
    atomic {
        for (j : 0 .. NP - 1) { pown[j] = NOBODY }
        for (j : 0 .. NL - 1) { dl[j] = L_NONE; xst[j] = X_NONE; xfull[j] = 1 }
        for (j : 0 .. NR - 1) { rq[j] = R_NONE }
        for (j : 0 .. NL - 1) { run lease(j) }
        for (j : 0 .. NR - 1) { run request(j) }
        run prefill_worker()
    }
}
