"""The first-run flow: which network, sign in, the electricity price, the GPUs to lend, start at
login and pausing for games, on a new install (`Settings.setup_complete` is False). Its last page
says what pressing Start will do (what is downloaded and how big, what the GPU will do, what it
earns): the desktop app's node downloads, starts and connects nothing before that.

Nothing is written until Finish: then the core saves the settings with `setup_complete` and applies
them, the login item follows the choice and the core hears of a new token. Cancel writes nothing,
so the flow is offered again at the next start. The token alone is kept as soon as it is given
(by `TokenForm`, in the keyring), since that is where a keyring problem must be shown.
"""

from __future__ import annotations

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (
    QButtonGroup,
    QCheckBox,
    QLabel,
    QRadioButton,
    QVBoxLayout,
    QWidget,
    QWizard,
    QWizardPage,
)

from app.bridge import Bridge
from app.format import games_seen, gib
from app.settings import GpuChoice, PriceField
from app.signin import TokenForm, account_link
from worker.system import autostart
from worker.system import networks
from worker.system import secrets
from worker.contract.events import NodeSnapshot
from worker.link.local.sizing import DEFAULT_LOCAL_MODEL_MIB
from worker.measure.prices import price_doubt
from worker.system.config import Settings
from worker.system.networks import Network

NETWORK, SIGN_IN, PRICE, GPUS, HABITS = range(5)


def _label(text: str, object_name: str = "") -> QLabel:
    label = QLabel(text)
    label.setWordWrap(True)
    if object_name:
        label.setObjectName(object_name)
    return label


def describe(network: Network) -> str:
    if network.is_local:
        return ("Try GPU Provider without an account: programs on this computer can use the model it "
                "serves. Nothing leaves this computer and nothing is earned.")
    return f"Serve people on {network.name} and earn {network.currency}. You need an account."


class NetworkPage(QWizardPage):
    def __init__(self, choices: tuple[Network, ...], chosen: Network) -> None:
        super().__init__()
        self.choices = choices
        layout = QVBoxLayout(self)
        layout.addWidget(_label("Where should your GPU work?", "heading"))
        self.group = QButtonGroup(self)
        self.buttons: list[QRadioButton] = []
        for index, network in enumerate(choices):
            button = QRadioButton(network.name)
            button.setChecked(network == chosen)
            self.group.addButton(button, index)
            self.buttons.append(button)
            layout.addWidget(button)
            layout.addWidget(_label(describe(network), "muted"))
        layout.addStretch(1)

    def network(self) -> Network:
        return self.choices[max(self.group.checkedId(), 0)]


class SignInPage(QWizardPage):
    """The token for the chosen network; a token kept earlier counts (the flow was cancelled after it)."""

    def __init__(self, network: Network) -> None:
        super().__init__()
        self.given = False  # a token was given in this flow: the core is told at Finish
        layout = QVBoxLayout(self)
        layout.addWidget(_label("Sign in", "heading"))
        self.status = _label("", "muted")
        layout.addWidget(self.status)
        self.form = TokenForm(network)
        self.form.kept.connect(self._kept)
        layout.addWidget(self.form)
        layout.addStretch(1)

    def initializePage(self) -> None:
        signed_in = secrets.get_token() is not None
        self.status.setText("You are signed in. Paste a new token only to replace it." if signed_in
                            else "Your token tells the network whom to pay for what this computer serves.")

    def validatePage(self) -> bool:
        if self.form.outcome == "session" or (not self.form.token.text().strip() and secrets.get_token()):
            return True
        return self.form.submit()

    def _kept(self, outcome: str) -> None:
        self.given = True
        if outcome == "session":
            self.wizard().next()


class PricePage(QWizardPage):
    def __init__(self, settings: Settings) -> None:
        super().__init__()
        layout = QVBoxLayout(self)
        layout.addWidget(_label("What does your electricity cost?", "heading"))
        layout.addWidget(_label("The price of one kWh, from your electricity bill. GPU Provider subtracts "
                                "what serving uses from what you earn. Use 0 to leave it out.", "muted"))
        self.price = settings.electricity_price_per_kwh  # what Finish saves, once this page accepted it
        self._asked: float | None = None  # a doubtful price already questioned: Next again keeps it
        self.price_field = PriceField(self.price, settings.currency)
        layout.addWidget(self.price_field)
        self.error = _label("", "error")
        self.error.hide()
        layout.addWidget(self.error)
        layout.addStretch(1)

    def validatePage(self) -> bool:
        problems: list[str] = []
        price = self.price_field.value(problems)
        if price is not None and price != self._asked:
            question = price_doubt(price, self.price_field.currency_code)
            if question is not None:
                self._asked = price
                problems.append(question + " Press Next again to keep it.")
        self.error.setText("\n".join(problems))
        self.error.setVisible(bool(problems))
        if price is not None and not problems:
            self.price = price
        return price is not None and not problems


class GpuPage(QWizardPage):
    def __init__(self, bridge: Bridge, settings: Settings) -> None:
        super().__init__()
        layout = QVBoxLayout(self)
        layout.addWidget(_label("Which GPUs may serve?", "heading"))
        layout.addWidget(_label("Untick a GPU to keep it for yourself.", "muted"))
        self.choice = GpuChoice(bridge, settings.gpus_to_lend)
        layout.addWidget(self.choice)
        self.error = _label("", "error")
        self.error.hide()
        layout.addWidget(self.error)
        layout.addStretch(1)

    def validatePage(self) -> bool:
        problem = self.choice.problem()
        self.error.setText(problem or "")
        self.error.setVisible(problem is not None)
        return problem is None


def what_happens(network: Network, snapshot: NodeSnapshot, lent: tuple[int, ...] | None) -> list[str]:
    """What pressing Start does, in three sentences: the download, the GPU's work, the money."""
    gpus = [g for g in snapshot.gpus if lent is None or g.index in lent]
    if network.is_local:
        download = (f"Downloads a small test model (about {gib(DEFAULT_LOCAL_MODEL_MIB)}) and the program that "
                    "runs it, once.")
    elif gpus:
        room = sum(g.memory_usable_mib or g.memory_total_mib for g in gpus)
        download = (f"Downloads the model {network.name} picks for your GPUs (at most {gib(room)}, the memory "
                    "they lend) and the program that runs it, once; another only when the network picks another.")
    else:
        download = (f"Downloads a small model {network.name} picks for this computer's processor, and the "
                    "program that runs it, once.")
    names = ", ".join(f"GPU {g.index} ({g.name})" for g in gpus)
    work = (f"{names} will answer people's chat requests. It stops when you pause from the tray"
            + (" or play a game." if games_seen(snapshot) else ".")) if gpus else (
        "This computer's processor will answer chat requests. It stops when you pause from the tray.")
    earn = ("Nothing is earned: only programs on this computer use it." if network.is_local else
            f"It earns {network.currency} for each answer; how much depends on the model and this computer's "
            "speed, so the dashboard shows it per hour once it has served (after electricity, at your price).")
    return [download, work, earn]


class HabitsPage(QWizardPage):
    def __init__(self, settings: Settings) -> None:
        super().__init__()
        layout = QVBoxLayout(self)
        layout.addWidget(_label("When should it serve?", "heading"))
        self.start_at_login = QCheckBox("Start GPU Provider when I log in")
        self.start_at_login.setChecked(settings.start_at_login)
        layout.addWidget(self.start_at_login)
        layout.addWidget(_label("It waits in the tray and serves while you are away.", "muted"))
        self.pause_for_games = QCheckBox("Pause when I play a game")
        self.pause_for_games.setChecked(settings.auto_pause_for_games)
        layout.addWidget(self.pause_for_games)
        self.games_note = _label("Serving stops the moment a game or another app uses the GPU, and "
                                 "starts again a while after it closes.", "muted")
        layout.addWidget(self.games_note)
        layout.addSpacing(12)
        layout.addWidget(_label("When you press Start", "heading"))
        self.summary = _label("")
        layout.addWidget(self.summary)
        self.error = _label("", "error")
        self.error.hide()
        layout.addWidget(self.error)
        layout.addStretch(1)

    def initializePage(self) -> None:
        """Says what Start will do with the choices of the pages before (they may have changed)."""
        flow = self.wizard()
        assert isinstance(flow, FirstRunFlow)
        snapshot = flow.bridge.latest
        seen = games_seen(snapshot)  # the game pause is offered only where it can work
        self.pause_for_games.setVisible(seen)
        self.games_note.setVisible(seen)
        self.summary.setText("\n".join(f"• {line}" for line in
                                        what_happens(flow.network(), snapshot, flow.gpu_page.choice.lent())))


class FirstRunFlow(QWizard):
    """Set up on a new install; `saved` carries the settings once they are saved and applied."""

    saved = Signal(object)  # Settings

    def __init__(
        self,
        settings: Settings,
        bridge: Bridge,
        startup: autostart.Autostart,
        *,
        chosen: Network | None = None,
        choices: tuple[Network, ...] | None = None,
        parent: QWidget | None = None,
    ) -> None:
        super().__init__(parent)
        self.setWindowTitle("Set up GPU Provider")
        self.setWizardStyle(QWizard.WizardStyle.ClassicStyle)  # no platform banner: the theme styles it all
        self.setOption(QWizard.WizardOption.NoBackButtonOnStartPage)
        self.setButtonText(QWizard.WizardButton.FinishButton, "Start")
        self.setButtonText(QWizard.WizardButton.CancelButton, "Later")  # asked again at the next start
        self.setMinimumWidth(560)
        self.settings = settings
        self.bridge = bridge
        self._startup = startup
        offered = choices or networks.choices()
        chosen = chosen or offered[0]
        if chosen not in offered:  # a network named on the command line
            offered = (chosen, *offered)
        self.network_page = NetworkPage(offered, chosen)
        self.sign_in_page = SignInPage(chosen)
        self.price_page = PricePage(settings)
        self.gpu_page = GpuPage(bridge, settings)
        self.habits_page = HabitsPage(settings)
        for page_id, page in ((NETWORK, self.network_page), (SIGN_IN, self.sign_in_page), (PRICE, self.price_page),
                              (GPUS, self.gpu_page), (HABITS, self.habits_page)):
            self.setPage(page_id, page)
        self.network_page.group.idToggled.connect(self._network_changed)
        self._network_changed()

    def network(self) -> Network:
        return self.network_page.network()

    def nextId(self) -> int:
        """The sign-in page is skipped for "only this computer": it has no accounts."""
        if self.currentId() == NETWORK and self.network().is_local:
            return PRICE
        return super().nextId()

    def _network_changed(self) -> None:
        network = self.network()
        self.price_page.price_field.set_currency(network.currency)
        if not network.is_local:
            self.sign_in_page.form.link.setText(account_link(network))

    def accept(self) -> None:
        """Finish: save (with `setup_complete`), apply, and follow the login item and token choices."""
        network = self.network()
        updated = self.settings.with_changes(
            coordinator_url=network.coordinator_url,
            currency=network.currency,
            electricity_price_per_kwh=self.price_page.price,
            gpus_to_lend=self.gpu_page.choice.lent(),
            start_at_login=self.habits_page.start_at_login.isChecked(),
            auto_pause_for_games=self.habits_page.pause_for_games.isChecked(),
            setup_complete=True,
        )
        try:
            autostart.apply_setting(self._startup, was_on=self.settings.start_at_login, now_on=updated.start_at_login)
            self.bridge.save_settings(updated)  # the core saves and applies them
        except OSError as exc:
            self.habits_page.error.setText(str(exc) if isinstance(exc, autostart.AutostartRefused) else
                                           f"Could not save the settings ({exc}). Check that the folder is "
                                           "writable, then press Start again.")
            self.habits_page.error.show()
            return
        if self.sign_in_page.given and not network.is_local:
            self.bridge.token_changed()
        self.settings = updated
        self.saved.emit(updated)
        super().accept()

